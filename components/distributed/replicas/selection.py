"""Which tensors are TP replicas, and the one order in which every rank visits them.

It owns the markers' meaning (read here, set through ``components.distributed.tp_replicas``): a
module's ``REDUCTION_ATTR`` is ``"mean"`` (also when unmarked), ``"sum"`` or ``"skip"`` (an excluded
subtree) and applies to its direct parameters; a parameter carrying ``MODEL_OWNED_ATTR`` is the
model's own shard. :func:`is_tp_replicated` decides by placements and mesh coordinates, never by
axis names alone. The order is (model part index, smallest fully qualified name), so collectives
line up across ranks whatever order modules were registered in. Nothing here is cached but a
rank's coordinate in a mesh: every function walks the model it is given.
"""

import functools
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

REDUCTION_ATTR = "_nemo_tp_replica_grad_reduction"
MODEL_OWNED_ATTR = "_nemo_model_owned_grad_divisor"
REDUCTIONS = ("mean", "sum")
SKIP = "skip"

# (index of the model part, fully qualified name): the rank-stable sort key
NameKey = tuple[int, str]
Entry = tuple[NameKey, nn.Parameter, Literal["mean", "sum", "skip"]]


def tp_replica_reduction(module: nn.Module) -> str:
    """The TP replica marker of ``module``: ``"mean"`` (also when unmarked), ``"sum"`` or
    ``"skip"``."""
    return getattr(module, REDUCTION_ATTR, "mean")


def get_tp_mesh(device_mesh: DeviceMesh | None, tp_axis_name: str) -> DeviceMesh | None:
    """Return a non-trivial TP submesh when one is present."""
    if device_mesh is None or tp_axis_name not in (device_mesh.mesh_dim_names or ()):
        return None
    tp_mesh = device_mesh[tp_axis_name]
    return tp_mesh if tp_mesh.size() > 1 else None


def is_tp_replicated(
    tensor: torch.Tensor, tp_group_ranks: tuple[int, ...], current_rank: int, tp_axis_name: str
) -> bool:
    """Return whether rank-local tensor storage is replicated across TP peers.

    A DTensor may live on a DP-only submesh even though physical copies exist for every TP
    coordinate. Conversely, an MoE mesh may fold the TP ranks into axes named ``ep`` or
    ``ep_shard``. Comparing mesh coordinates and placements keeps both cases explicit instead of
    assuming every unnamed TP dimension is a copy.

    Args:
        tensor: Tensor or DTensor of arbitrary global and rank-local shape.
        tp_group_ranks: Ordered global ranks in the current TP group.
        current_rank: Current global rank.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns: Whether every TP peer represented in the tensor mesh differs only along dimensions
        carrying ``Replicate`` placements. A plain tensor is a full copy on every rank, hence
        ``True``; a DTensor whose mesh does not contain the current rank has no storage here, hence
        ``False``.
    """
    if not isinstance(tensor, DTensor):
        return True
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ()
    if tp_axis_name in names:
        return isinstance(tensor.placements[names.index(tp_axis_name)], Replicate)

    own = _coordinate(mesh, current_rank)
    if own is None:
        return False
    for peer in tp_group_ranks:
        peer_coordinate = _coordinate(mesh, peer)
        if peer_coordinate is None:
            continue  # the peer is outside this mesh and holds its own physical copy
        for dim, (mine, theirs) in enumerate(zip(own, peer_coordinate, strict=True)):
            if mine != theirs and not isinstance(tensor.placements[dim], Replicate):
                return False
    return True


@functools.cache
def _coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate in ``mesh``, or None outside it; found once per mesh and rank (the
    mesh's rank tensor is read on the host), not at every step's replica sync."""
    found = (mesh.mesh == rank).nonzero()
    return tuple(found[0].tolist()) if len(found) else None


def _name(module_name: str, local_name: str) -> str:
    return f"{module_name}.{local_name}" if module_name else local_name


def _parameter_owners(model_parts: list[nn.Module]) -> dict[nn.Parameter, Entry]:
    """Each unique parameter (a dict keyed by the object) to its entry, in registration order.

    Owners that disagree about a shared parameter raise ``ValueError`` naming it.
    """
    owners: dict[nn.Parameter, Entry] = {}
    for part_index, part in enumerate(model_parts):
        for module_name, module in part.named_modules(remove_duplicate=False):
            marker = tp_replica_reduction(module)
            if marker not in (*REDUCTIONS, SKIP):
                raise ValueError(
                    f"Module {module_name!r} has an unknown TP replica marker {marker!r}"
                )
            for local_name, parameter in module.named_parameters(recurse=False):
                key = (part_index, _name(module_name, local_name))
                seen = owners.get(parameter)
                if seen is None:
                    owners[parameter] = (key, parameter, marker)
                    continue
                if seen[2] != marker:
                    first, second = sorted([(seen[0], seen[2]), (key, marker)])
                    raise ValueError(
                        f"Shared parameter {first[0][1]!r} (also {second[0][1]!r}) has conflicting "
                        f"TP replica markers {first[1]!r} and {second[1]!r}; mark every owner of a "
                        "tied parameter alike"
                    )
                owners[parameter] = (min(seen[0], key), parameter, marker)
    return owners


def unmarked_entries(model_parts: list[nn.Module], by_name: bool = True) -> list[Entry]:
    """Entries outside excluded subtrees and without the model-owned marker, each parameter once.

    ``by_name``: in rank-stable (part, smallest name) order, for collectives; else registration
        order.
    """
    entries = [
        entry
        for entry in _parameter_owners(model_parts).values()
        if entry[2] != SKIP and not hasattr(entry[1], MODEL_OWNED_ATTR)
    ]
    return sorted(entries, key=lambda entry: entry[0]) if by_name else entries


def unique_buffers(model_parts: list[nn.Module]) -> list[torch.Tensor]:
    """Buffers outside excluded subtrees, each once (a shared one by its smallest name), by name."""
    keys: dict[torch.Tensor, tuple[NameKey, torch.Tensor]] = {}
    excluded: set[torch.Tensor] = set()
    for part_index, part in enumerate(model_parts):
        for module_name, module in part.named_modules(remove_duplicate=False):
            skipped = tp_replica_reduction(module) == SKIP
            for local_name, buffer in module.named_buffers(recurse=False):
                if skipped:
                    excluded.add(buffer)
                key = (part_index, _name(module_name, local_name))
                seen = keys.get(buffer)
                keys[buffer] = (key if seen is None else min(seen[0], key), buffer)
    kept = [entry for buffer, entry in keys.items() if buffer not in excluded]
    return [buffer for _, buffer in sorted(kept, key=lambda entry: entry[0])]
