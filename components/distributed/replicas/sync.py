"""``ReplicaSync``: the TP replica sync of one model on one mesh, built once and held by its caller.

It owns the TP group (sliced from the mesh once), the plan (the trainable TP replicas in rank-stable
order with their reductions, chosen by ``selection``), the flat buffers (``buckets.BucketLayout``)
and their invalidation, which is explicit: :meth:`ReplicaSync.refresh` drops the plan and its
buffers, and every :meth:`ReplicaSync.synchronize` first compares the fingerprint taken with the
plan (every module and parameter still in its slot, none added anywhere, the same markers, each
replica's ``requires_grad``; no module walk) and rebuilds on a mismatch. Gradients given other
storage or another dtype are seen by the buffers (data pointers, dtypes). Only the model-owned
attribute set on a parameter after the first call needs ``refresh()``. Nothing is global or kept on
the model: drop the object and its plan goes.
"""

from itertools import repeat
from operator import attrgetter, is_
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from components.distributed.replicas.buckets import BucketLayout
from components.distributed.replicas.flat_buffers import MAX_FLAT_BUFFER_BYTES, local_tensor
from components.distributed.replicas.selection import (
    REDUCTION_ATTR,
    get_tp_mesh,
    is_tp_replicated,
    unique_buffers,
    unmarked_entries,
)

_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
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


def tp_replicas(
    model_parts: list[nn.Module], tp: TpGroup, tp_axis_name: str
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every TP-replicated parameter, trainable or not, by name."""
    return [
        (key[1], parameter, reduction)
        for key, parameter, reduction in unmarked_entries(model_parts)
        if is_tp_replicated(parameter, tp.ranks, tp.rank, tp_axis_name)
    ]


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

    def _read_markers(self) -> list:
        return list(map(dict.get, self._attributes, repeat(REDUCTION_ATTR)))

    def same_structure(self) -> bool:
        """Nothing added, removed or replaced, no marker changed, no frozen replica thawed."""
        return (
            sum(map(len, self._dicts)) == self._length
            and all(map(is_, map(dict.get, self._entry_dicts, self._entry_names), self._entries))
            and self._read_markers() == self._markers
            and not any(map(_requires_grad, self._frozen))
        )

    def still_trainable(self) -> bool:
        """Every trainable replica still requires grad (read after their gradients, while warm)."""
        return all(map(_requires_grad, self._trainable))


class _Plan:
    """Trainable replicas of one model for one TP group, in rank-stable order, and their buckets."""

    def __init__(
        self, model_parts: list[nn.Module], tp: TpGroup, tp_axis_name: str, max_bytes: int
    ):
        replicas = tp_replicas(model_parts, tp, tp_axis_name)
        candidates = [entry for entry in replicas if entry[1].requires_grad]
        frozen = [parameter for _, parameter, _ in replicas if not parameter.requires_grad]
        self.tp, self.tp_axis_name, self.max_bytes = tp, tp_axis_name, max_bytes
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
        self._full_local_shapes: list[torch.Size] = []
        self._full_dtypes: list[torch.dtype] = []

    def local_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads if self.all_plain else list(map(local_tensor, grads))

    def layout(self, local_grads: list[torch.Tensor | None], eligible: list[int]) -> BucketLayout:
        """A layout without persistent buffers, for an unusual step (some gradients missing)."""
        device, bound = self.tp.mesh.device_type, self.max_bytes
        return BucketLayout(
            local_grads, self.reductions, eligible, self.plain, device, bound, persistent=False
        )

    def full_layout(self, grads: list[torch.Tensor]) -> BucketLayout | None:
        """The persistent layout when every gradient is present (None if DTensor shapes moved)."""
        shapes = [local_tensor(grads[i]).shape for i in self._dtensor_indices]
        dtypes = list(map(_dtype, grads))
        # first full step, or the model was cast
        if self.full is None or dtypes != self._full_dtypes:
            self.full = None  # its buffers go before the new ones are made
            everyone = list(range(len(grads)))
            device = self.tp.mesh.device_type
            self.full = BucketLayout(
                self.local_grads(grads),
                self.reductions,
                everyone,
                self.plain,
                device,
                self.max_bytes,
            )
            self._full_local_shapes, self._full_dtypes = shapes, dtypes
        return self.full if shapes == self._full_local_shapes else None

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


class ReplicaSync:
    """Broadcast TP replicas at start-up and reduce their gradients once per optimizer update.

    Build it once the model is parallelised (and loaded); keep it as long as the model. The contract
    is ``tp_replicas``' (``../shared/spec/tp_replicas-api.md``); see the module docstring for what
    it rebuilds by itself and what needs :meth:`refresh`.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        device_mesh: DeviceMesh | None,
        tp_axis_name: str = "tp",
        *,
        max_bytes: int = MAX_FLAT_BUFFER_BYTES,
    ):
        self.model_parts = list(model_parts)
        self.tp_axis_name, self.max_bytes = tp_axis_name, max_bytes
        self.tp = tp_group(device_mesh, tp_axis_name)
        self.plans_built = 0  # how often the plan was (re)built: for tests and benchmarks
        self._plan: _Plan | None = None

    def refresh(self) -> None:
        """Forget the plan and its buffers; the next :meth:`synchronize` rebuilds them."""
        self._plan = None

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter, str]]:
        """(name, parameter, reduction) of every TP replica, trainable or not, in rank-stable
        order."""
        return [] if self.tp is None else tp_replicas(self.model_parts, self.tp, self.tp_axis_name)

    @torch.no_grad()
    def broadcast(self) -> int:
        """Copy every replicated parameter and buffer from TP rank 0; the number of tensors
        copied."""
        tp = self.tp
        if tp is None:
            return 0
        source = dist.get_global_rank(tp.group, 0)
        parameters = [parameter for _, parameter, _ in unmarked_entries(self.model_parts)]
        count = 0
        for tensor in [*parameters, *unique_buffers(self.model_parts)]:
            if not is_tp_replicated(tensor, tp.ranks, tp.rank, self.tp_axis_name):
                continue
            local = local_tensor(tensor)
            if local.is_meta or local.numel() == 0:
                continue
            wire = (
                local if local.device.type == tp.mesh.device_type else local.to(tp.mesh.device_type)
            )
            dist.broadcast(wire, src=source, group=tp.group)
            if wire is not local:
                local.copy_(wire)
            count += 1
        return count

    def _current_plan(self, rebuild: bool = False) -> _Plan:
        plan = self._plan
        if rebuild or plan is None or not plan.fingerprint.same_structure():
            self._plan = None  # the old buffers go before the new ones are made
            plan = self._plan = _Plan(self.model_parts, self.tp, self.tp_axis_name, self.max_bytes)
            self.plans_built += 1
        return plan

    @torch.no_grad()
    def synchronize(self) -> int:
        """Reduce the replicas' gradients (mean or sum) in place; the number synchronised here."""
        tp = self.tp
        if tp is None:
            return 0
        plan = self._current_plan()
        if not plan.parameters:
            return 0
        full = plan.full
        in_place = full is not None and full.gradients_are_views(plan.parameters)
        if not plan.fingerprint.still_trainable():  # read here, just after their gradients
            plan, full, in_place = self._current_plan(rebuild=True), None, False
            if not plan.parameters:
                return 0
        if in_place:  # every gradient is its bucket view: present, dense, eligible; flags known
            flags = plan.dense_device_flags.clone()
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=tp.group)
            if torch.equal(flags, plan.expected_flags):
                return full.reduce(plan.parameters, full.views_in_order, tp.group, tp.size, True)
            # another rank disagrees: raise below, or reduce what is eligible
            grads = full.views_in_order
        else:
            grads = list(map(_grad, plan.parameters))
            flags = plan.precheck_flags(grads).to(tp.mesh.device_type)
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=tp.group)
        if torch.equal(flags, plan.expected_flags):  # every gradient present, eligible and dense
            layout, local_grads = plan.full_layout(grads), plan.local_grads(grads)
            if layout is None:
                layout = plan.layout(local_grads, list(range(len(grads))))
        else:
            eligible = plan.check_flags(flags)
            local_grads = [local_tensor(g) if g is not None else None for g in grads]
            layout = plan.layout(local_grads, eligible)
        return layout.reduce(plan.parameters, local_grads, tp.group, tp.size)
