"""The plan behind ``tp_replicas.synchronize_tp_replica_gradients``, kept with the model it serves.

A plan holds the TP group (sliced from the mesh once), the trainable TP replicas in rank-stable
order with their reductions (chosen by ``selection``), the pre-check flags and the flat buffers
(``buckets.BucketLayout``). :func:`cached_plan` keeps it in the first model part's ``__dict__``, so
it lives and dies with the model (a reference cycle the garbage collector frees; a
``WeakKeyDictionary`` could not hold it, since a plan reaches its key through the modules' own
dictionaries and hooks) and a copy or pickle of the model starts without one. Each call compares
the plan's fingerprint, a few C-level passes and no module walk: the same model parts, mesh, axis
and byte bound, every module and parameter still in its slot, none added anywhere, the same markers,
each replica's ``requires_grad`` and model-owned attribute; a mismatch rebuilds it. Gradients given
other storage, another dtype, shape or device are seen by the buffers (data pointers, then dtypes,
shapes and devices). Nothing here issues a collective: ``tp_replicas`` does, through its ``dist``.
"""

import weakref
from itertools import repeat
from operator import attrgetter, contains, is_
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from components.distributed.replicas.buckets import BucketLayout
from components.distributed.replicas.flat_buffers import local_tensor
from components.distributed.replicas.selection import (
    MODEL_OWNED_ATTR,
    REDUCTION_ATTR,
    get_tp_mesh,
    is_tp_replicated,
    unmarked_entries,
)

_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
_device = attrgetter("device")
_size = torch.Tensor.size  # a few times cheaper than reading .shape
_layout = attrgetter("layout")
_requires_grad = attrgetter("requires_grad")


class TpGroup(NamedTuple):
    """The TP submesh, its process group, its global ranks, this rank and the group's size."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    rank: int
    size: int


def tp_group(device_mesh: DeviceMesh | None, tp_axis_name: str = "tp") -> TpGroup | None:
    """The TP group of ``device_mesh``; None without a TP axis of size > 1."""
    tp_mesh = get_tp_mesh(device_mesh, tp_axis_name)
    if tp_mesh is None:
        return None
    group = tp_mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    return TpGroup(tp_mesh, group, ranks, dist.get_rank(), len(ranks))


def replicated_parameters(
    model_parts: list[nn.Module], tp: TpGroup, tp_axis_name: str
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every TP-replicated parameter, trainable or not, by name."""
    return [
        (key[1], parameter, reduction)
        for key, parameter, reduction in unmarked_entries(model_parts)
        if is_tp_replicated(parameter, tp.ranks, tp.rank, tp_axis_name)
    ]


def tp_replicated_parameters(
    model_parts: list[nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every TP replica, trainable or not, in rank-stable order:
    what ``broadcast_tp_replicas`` copies and, among those that require grad,
    ``synchronize_tp_replica_gradients`` reduces. Empty without a TP axis of size > 1."""
    tp = tp_group(device_mesh, tp_axis_name)
    return [] if tp is None else replicated_parameters(model_parts, tp, tp_axis_name)


class _Fingerprint:
    """The structure of the model parts when a plan was built, compared in a few C-level passes.

    About 0.3 ms for 1,000 modules and parameters (warm): dictionary sizes, entry identities,
    markers.
    """

    def __init__(self, model_parts: list[nn.Module], trainable: list, frozen: list):
        modules = [module for part in model_parts for module in part.modules()]
        self._dicts = [m._modules for m in modules] + [m._parameters for m in modules]
        self._length = sum(map(len, self._dicts))
        self._entry_dicts = [entries for entries in self._dicts for _ in entries]
        self._entry_names = [name for entries in self._dicts for name in entries]
        self._entries = [value for entries in self._dicts for value in entries.values()]
        self._attributes = list(map(vars, modules))
        self._markers = self._read_markers()
        self._trainable, self._frozen = trainable, frozen
        self._replica_attributes = list(map(vars, [*trainable, *frozen]))

    def _read_markers(self) -> list:
        return list(map(dict.get, self._attributes, repeat(REDUCTION_ATTR)))

    def same_structure(self) -> bool:
        """Nothing added, removed or replaced, no marker changed, no frozen replica thawed, no
        replica become model-owned."""
        return (
            sum(map(len, self._dicts)) == self._length
            and all(map(is_, map(dict.get, self._entry_dicts, self._entry_names), self._entries))
            and self._read_markers() == self._markers
            and not any(map(_requires_grad, self._frozen))
            and not any(map(contains, self._replica_attributes, repeat(MODEL_OWNED_ATTR)))
        )

    def still_trainable(self) -> bool:
        """Every trainable replica still requires grad (read after their gradients, while warm)."""
        return all(map(_requires_grad, self._trainable))


class Plan:
    """Trainable replicas of one model for one TP group, in rank-stable order, and their buckets."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        device_mesh: DeviceMesh,
        tp: TpGroup,
        tp_axis_name: str,
        max_bytes: int,
    ):
        replicas = replicated_parameters(model_parts, tp, tp_axis_name)
        candidates = [entry for entry in replicas if entry[1].requires_grad]
        frozen = [parameter for _, parameter, _ in replicas if not parameter.requires_grad]
        self.tp, self.tp_axis_name, self.max_bytes = tp, tp_axis_name, max_bytes
        self.device_mesh = device_mesh
        self.parts = [weakref.ref(part) for part in model_parts]
        self.names = [name for name, _, _ in candidates]
        self.parameters = [parameter for _, parameter, _ in candidates]
        self.reductions = [reduction for _, _, reduction in candidates]
        self.fingerprint = _Fingerprint(model_parts, self.parameters, frozen)
        self.plain = [not isinstance(parameter, DTensor) for parameter in self.parameters]
        self.all_plain = all(self.plain)
        count = len(candidates)
        self.dense_flags = torch.tensor([[1] * count, [1] * count, [0] * count], dtype=torch.int32)
        self.dense_device_flags = self.dense_flags.to(tp.mesh.device_type)
        self.expected_flags = (self.dense_flags * tp.size).to(tp.mesh.device_type)
        self._dtensor_indices = [index for index, plain in enumerate(self.plain) if not plain]
        self.full: BucketLayout | None = None  # the persistent layout, built at the first full step
        self._full_local_shapes: list[torch.Size] = []  # of the DTensor gradients
        self._full_plain_shapes: list[torch.Size] = []
        self._full_kinds: tuple[list, list] = ([], [])  # dtypes and devices

    def local_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads if self.all_plain else list(map(local_tensor, grads))

    def layout(self, local_grads: list[torch.Tensor | None], eligible: list[int]) -> BucketLayout:
        """A layout without persistent buffers, for an unusual step (some gradients missing)."""
        device, bound = self.tp.mesh.device_type, self.max_bytes
        return BucketLayout(
            local_grads, self.reductions, eligible, self.plain, device, bound, persistent=False
        )

    def full_layout(self, local_grads: list[torch.Tensor]) -> BucketLayout | None:
        """The persistent layout when every gradient is present: rebuilt when a gradient's dtype,
        device or plain shape changed (a cast or moved model); None if DTensor local shapes
        moved."""
        shapes = list(map(_size, local_grads))
        kinds = (list(map(_dtype, local_grads)), list(map(_device, local_grads)))
        plain = shapes
        if not self.all_plain:
            plain = [shape for shape, kept in zip(shapes, self.plain, strict=True) if kept]
        if self.full is None or kinds != self._full_kinds or plain != self._full_plain_shapes:
            self.full = None  # its buffers go before the new ones are made
            everyone = list(range(len(local_grads)))
            device, bound = self.tp.mesh.device_type, self.max_bytes
            self.full = BucketLayout(
                local_grads, self.reductions, everyone, self.plain, device, bound
            )
            self._full_kinds, self._full_plain_shapes = kinds, plain
            self._full_local_shapes = [shapes[i] for i in self._dtensor_indices]
        moved = [shapes[i] for i in self._dtensor_indices] != self._full_local_shapes
        return None if moved else self.full

    def precheck_flags(self, grads: list) -> torch.Tensor:
        """Per candidate [present, eligible, sparse], as one int32 tensor built at once."""
        if (
            self.all_plain
            and not any(map(is_, grads, repeat(None)))
            and all(map(is_, map(_layout, grads), repeat(torch.strided)))
        ):
            return self.dense_flags.clone()
        tp, present, eligible, sparse = self.tp, [], [], []
        for grad in grads:
            present.append(grad is not None)
            eligible.append(
                grad is not None and is_tp_replicated(grad, tp.ranks, tp.rank, self.tp_axis_name)
            )
            sparse.append(grad is not None and local_tensor(grad).layout != torch.strided)
        return torch.tensor([present, eligible, sparse], dtype=torch.int32)

    def check_flags(self, flags: torch.Tensor) -> list[int]:
        """Raise (on every rank alike) if the summed flags disagree; return the indices to
        reduce."""
        present, eligible, sparse = flags.cpu().tolist()
        size = self.tp.size

        def names(counts: list[int], bad) -> str:
            return ", ".join(
                name for name, count in zip(self.names, counts, strict=True) if bad(count)
            )

        def partly(count: int) -> bool:
            return 0 < count < size

        if any(map(partly, present)):
            raise RuntimeError(
                f"Gradient presence differs across TP replicas: {names(present, partly)}"
            )
        if any(map(partly, eligible)):
            raise RuntimeError(
                f"Gradient placements differ across TP replicas: {names(eligible, partly)}"
            )
        if any(sparse):
            message = "Sparse gradients cannot be flattened for TP replica synchronization"
            raise RuntimeError(f"{message}: {names(sparse, bool)}")
        # no gradient anywhere, or Partial/Shard on TP: left exactly as it is
        return [index for index, count in enumerate(eligible) if count > 0]

    def serves(
        self,
        model_parts: list[nn.Module],
        device_mesh: DeviceMesh | None,
        tp_axis_name: str,
        max_bytes: int,
    ) -> bool:
        """The same parts, mesh, axis and bound as when built, and the same structure."""
        return (
            device_mesh is self.device_mesh
            and tp_axis_name == self.tp_axis_name
            and max_bytes == self.max_bytes
            and len(model_parts) == len(self.parts)
            and all(map(is_, model_parts, (part() for part in self.parts)))
            and self.fingerprint.same_structure()
        )


class _PlanSlot:
    """The cached plan in a model part's ``__dict__``; a copy or pickle of the part gets an empty
    slot, so a copied model never reuses the original's buffers."""

    __slots__ = ("plan", "no_tp")

    def __init__(self):
        self.plan: Plan | None = None
        self.no_tp: tuple[DeviceMesh | None, str] | None = None  # a mesh known to have no TP

    def __copy__(self) -> "_PlanSlot":
        return _PlanSlot()

    def __deepcopy__(self, memo: dict) -> "_PlanSlot":
        return _PlanSlot()

    def __reduce__(self):
        return (_PlanSlot, ())


_PLAN_ATTR = "_tp_replica_plan"


def _kept_plan(model_parts: list[nn.Module]) -> Plan | None:
    """The plan kept with these model parts, as it is (not checked against them)."""
    slot = model_parts[0].__dict__.get(_PLAN_ATTR) if model_parts else None
    return None if slot is None else slot.plan


def bind_gradients(
    model_parts: list[nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str
) -> int:
    """Make the zeroed slots of the kept plan's buckets the replicas' gradients (see
    ``BucketLayout.bind``); 0, binding nothing, without a plan for these parts and this mesh whose
    buckets are all gradient views, or when a parameter no longer fits its slot."""
    plan = _kept_plan(model_parts)
    if (
        plan is None
        or plan.full is None
        or plan.full.views_in_order is None  # some bucket is staged: nothing to bind
        or plan.device_mesh is not device_mesh
        or plan.tp_axis_name != tp_axis_name
        or len(model_parts) != len(plan.parts)
        or not all(map(is_, model_parts, (part() for part in plan.parts)))
    ):
        return 0
    return plan.full.bind(plan.parameters)  # 0 where a parameter no longer fits its slot


def release_untouched_gradients(model_parts: list[nn.Module]) -> bool:
    """Give ``None`` back to the bound gradients the backward did not reach (see
    ``BucketLayout.release_untouched``); nothing if none were bound. True when every bound
    gradient was reached (each of those parameters required grad in the backward)."""
    plan = _kept_plan(model_parts)
    return plan is not None and plan.full is not None and plan.full.release_untouched()


def cached_plan(
    model_parts: list[nn.Module],
    device_mesh: DeviceMesh | None,
    tp_axis_name: str,
    max_bytes: int,
    rebuild: bool = False,
) -> Plan | None:
    """The plan for these model parts on this mesh, reused while it serves them, else built (and
    kept); None without a TP axis of size > 1 or without model parts."""
    if not model_parts:
        return None
    slot = model_parts[0].__dict__.get(_PLAN_ATTR)
    if slot is None:
        slot = model_parts[0].__dict__[_PLAN_ATTR] = _PlanSlot()
    plan, key = slot.plan, (device_mesh, tp_axis_name)
    if plan is not None and not rebuild and plan.serves(model_parts, *key, max_bytes):
        return plan
    if slot.no_tp is not None and slot.no_tp[0] is device_mesh and slot.no_tp[1] == tp_axis_name:
        return None  # this mesh was seen before: no TP axis of size > 1
    same_group = plan is not None and plan.device_mesh is device_mesh
    tp = plan.tp if same_group and plan.tp_axis_name == tp_axis_name else tp_group(*key)
    slot.plan = None  # the old buffers go before the new ones are made
    if tp is None:
        slot.no_tp = key
        return None
    slot.plan = Plan(model_parts, device_mesh, tp, tp_axis_name, max_bytes)
    return slot.plan
