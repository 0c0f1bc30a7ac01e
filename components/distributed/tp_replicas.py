"""Keep the parameters that tensor parallelism does not shard identical on every TP rank.

Under TP, norms, routers, q/k norms and small projections are full copies on every rank of a TP group.
Two things make the copies drift apart, and this module fixes both:

1. Start-up. Ranks may initialise or load differently. Call :func:`broadcast_tp_replicas` once the model
   is built (after the TP plan and weight loading, before the optimizer is created).
2. Training. Each rank computes its own gradient for its copy. Call
   :func:`synchronize_tp_replica_gradients` exactly once per optimizer update, after gradient
   accumulation and DTensor gradient finalisation, before loss-scale unscaling, grad norm, clipping and
   ``optimizer.step()``. Unmarked modules are *mean*-reduced (every rank computed the same thing); modules
   marked ``"sum"`` with :func:`mark_tp_replica_gradient_reduction` produced disjoint partial
   contributions and are sum-reduced, so calling it twice per update is wrong, not idempotent.

What is *not* a replica is left alone: DTensors sharded (or, for gradients, partial) on the TP axis,
parameters carrying ``_MODEL_OWNED_GRAD_DIVISOR_ATTR``, and whole subtrees passed to
:func:`exclude_from_tp_replica_sync` (expert modules whose local tensors are different experts).

Choices where the specification is silent:
- Markers live on modules, not tensors, so they survive parameter replacement.
- A shared parameter whose owning modules disagree (``"mean"``, ``"sum"`` or ``"skip"``) is a
  ``ValueError`` naming it, raised before any collective.
- The pre-check all-reduce also carries a per-parameter "sparse" flag, so a sparse gradient on any one
  rank makes every rank raise together instead of leaving its peers waiting in a collective.
- A DTensor whose mesh does not contain the current rank has no storage here: it is not a replica.
- Every rank of a TP group must hold the same module structure (the same candidates in the same name
  order); that is what makes one fixed-size pre-check all-reduce possible.

Speed (the contract unchanged): what to reduce is computed once per model and TP group and cached
(``replica_plan``); it is rebuilt when a parameter is replaced (also through ``module._parameters``, as FSDP2
does), a module or parameter is added or deleted, a marker is set through the functions above, a replica is
frozen or thawed, or ``_MAX_FLAT_BUFFER_BYTES`` changes. The per-call check reads no module's attributes (a
registration counter kept by torch's global hooks, child counts, the replicas' slots and ``requires_grad``);
a marker attribute set directly, or a module replaced directly in ``module._modules``, is seen once anything
registers a module or parameter. Set markers through the functions above and ``_MODEL_OWNED_GRAD_DIVISOR_ATTR``
before the first sync. Buffers persist between calls, within ``_MAX_FLAT_BUFFER_BYTES`` in all, and go away
with the model: FP32 (wire-dtype) gradients of plain parameters become views of their bucket after the first
call, so while the caller keeps them (``zero_grad(set_to_none=False)``) the pre-check flags are a constant
(every gradient is its bucket view: present, dense, eligible) and the all-reduce runs in place; a caller that
sets gradients to None gets them packed (one ``torch.cat`` for 1-D gradients, else one
``torch._foreach_copy_``) and re-bound each step, with the flags built in one pass. Other gradients (bf16/fp16,
DTensor) go through one shared staging buffer, bucket after bucket. A step where some candidates have no
gradient anywhere uses transient buffers. A mean over a power-of-two TP size multiplies by the exact
reciprocal (the same rounding as the divide, and cheaper).

Every collective is called through ``dist.<name>`` at call time so tests can intercept them.
"""

import weakref
from collections.abc import Iterator
from itertools import repeat
from operator import attrgetter, is_
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from components.distributed.replicas.flat_buffers import bounded_chunks, local_tensor, wire_dtype
from components.distributed.replicas.plan import BucketLayout, ModelSnapshot, bump_structure_version, model_cache

_TP_REPLICA_GRAD_REDUCTION_ATTR = "_nemo_tp_replica_grad_reduction"
_MODEL_OWNED_GRAD_DIVISOR_ATTR = "_nemo_model_owned_grad_divisor"
_MAX_FLAT_BUFFER_BYTES = 256 * 1024 * 1024

_REDUCTIONS = ("mean", "sum")
_SKIP = "skip"

# (index of the model part, fully qualified name): the rank-stable sort key of a tensor.
_NameKey = tuple[int, str]


def mark_tp_replica_gradient_reduction(module: torch.nn.Module, reduction: Literal["mean", "sum"]) -> None:
    """Mark direct parameters of a module with their TP-replica reduction semantic.

    Use ``"sum"`` where each TP rank saw a disjoint part of the work (a norm on head-sharded q/k, a
    router on sequence-sharded tokens); unmarked modules default to ``"mean"``. The marker is stored on
    the module and applies to its direct parameters only (``recurse=False``).

    Args:
        module: Module whose direct parameters are replicated across TP ranks.
        reduction: ``"mean"`` for redundant full computation or ``"sum"`` for disjoint partial
            contributions.

    Raises:
        ValueError: If ``reduction`` is neither ``"mean"`` nor ``"sum"``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"TP replica gradient reduction must be 'mean' or 'sum', got {reduction!r}")
    setattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, reduction)
    bump_structure_version()  # cached sync plans are rebuilt


def exclude_from_tp_replica_sync(module: torch.nn.Module) -> None:
    """Exclude an owner-sharded module subtree from TP replica synchronization.

    Some parameter owners use a mesh that folds physical TP ranks into another logical axis (expert
    parallelism folded onto the TP ranks). Their local tensors are different shards, even though they
    are not DTensors carrying an explicit ``tp`` placement. Marking the complete subtree keeps both
    parameter and buffer synchronization from treating those owner-local tensors as TP replicas. Call it
    after the subtree is built: modules added below it later are not marked.

    Args:
        module: Owner-sharded module whose current subtree must remain local.
    """
    for submodule in module.modules():
        setattr(submodule, _TP_REPLICA_GRAD_REDUCTION_ATTR, _SKIP)
    bump_structure_version()  # cached sync plans are rebuilt


def _get_tp_mesh(device_mesh: DeviceMesh | None, tp_axis_name: str) -> DeviceMesh | None:
    """Return a non-trivial TP submesh when one is present."""
    if device_mesh is None or tp_axis_name not in (device_mesh.mesh_dim_names or ()):
        return None
    tp_mesh = device_mesh[tp_axis_name]
    return tp_mesh if tp_mesh.size() > 1 else None


def _gradient_reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return an FP32 communication dtype for low-precision gradients."""
    return wire_dtype(dtype)


def _gradient_chunks(gradients: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Split gradients into bounded communication buffers.

    Args:
        gradients: Dense rank-local gradients of arbitrary shape on one device with one dtype.
            Low-precision elements are budgeted at their FP32 communication size.

    Yields:
        Consecutive lists, in input order, whose flat communication buffer holds at most
        ``_MAX_FLAT_BUFFER_BYTES``; a single larger gradient is a chunk of its own.
    """
    return bounded_chunks(gradients, _MAX_FLAT_BUFFER_BYTES)


def _is_tp_replicated(
    tensor: torch.Tensor, tp_group_ranks: tuple[int, ...], current_rank: int, tp_axis_name: str
) -> bool:
    """Return whether rank-local tensor storage is replicated across TP peers.

    A DTensor may live on a DP-only submesh even though physical copies exist for every TP coordinate.
    Conversely, an MoE mesh may fold the TP ranks into axes named ``ep`` or ``ep_shard``. Comparing mesh
    coordinates and placements keeps both cases explicit instead of assuming every unnamed TP dimension
    is a copy.

    Args:
        tensor: Tensor or DTensor of arbitrary global and rank-local shape.
        tp_group_ranks: Ordered global ranks in the current TP group.
        current_rank: Current global rank.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns:
        Whether every TP peer represented in the tensor mesh differs only along dimensions carrying
        ``Replicate`` placements. A plain tensor is a full copy on every rank, hence ``True``.
    """
    if not isinstance(tensor, DTensor):
        return True
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ()
    if tp_axis_name in names:
        return isinstance(tensor.placements[names.index(tp_axis_name)], Replicate)

    def coordinate(rank: int) -> list[int] | None:
        found = (mesh.mesh == rank).nonzero()
        return found[0].tolist() if len(found) else None

    own = coordinate(current_rank)
    if own is None:
        return False
    for peer in tp_group_ranks:
        peer_coordinate = coordinate(peer)
        if peer_coordinate is None:
            continue  # the peer is outside this mesh and holds its own physical copy
        for dim, (mine, theirs) in enumerate(zip(own, peer_coordinate, strict=True)):
            if mine != theirs and not isinstance(tensor.placements[dim], Replicate):
                return False
    return True


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return rank-local storage for a Tensor or DTensor."""
    return local_tensor(tensor)


def _parameter_owners(model_parts: list[torch.nn.Module]) -> dict[int, tuple[_NameKey, torch.nn.Parameter, str]]:
    """Map each unique parameter to (smallest name key, parameter, owner marker), in registration order.

    The marker is ``"mean"``, ``"sum"`` or ``"skip"``. Owners that disagree about a shared parameter
    raise ``ValueError`` naming it.
    """
    owners: dict[int, tuple[_NameKey, torch.nn.Parameter, str]] = {}
    for part_index, part in enumerate(model_parts):
        for module_name, module in part.named_modules(remove_duplicate=False):
            marker = getattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, "mean")
            if marker not in (*_REDUCTIONS, _SKIP):
                raise ValueError(f"Module {module_name!r} has an unknown TP replica marker {marker!r}")
            for local_name, parameter in module.named_parameters(recurse=False):
                key = (part_index, f"{module_name}.{local_name}" if module_name else local_name)
                seen = owners.get(id(parameter))
                if seen is None:
                    owners[id(parameter)] = (key, parameter, marker)
                    continue
                if seen[2] != marker:
                    first, second = sorted([(seen[0], seen[2]), (key, marker)])
                    raise ValueError(
                        f"Shared parameter {first[0][1]!r} (also {second[0][1]!r}) has conflicting TP replica "
                        f"markers {first[1]!r} and {second[1]!r}; mark every owner of a tied parameter alike"
                    )
                owners[id(parameter)] = (min(seen[0], key), parameter, marker)
    return owners


def _unmarked_entries(model_parts: list[torch.nn.Module]) -> list[tuple[_NameKey, torch.nn.Parameter, str]]:
    """Owner entries, in registration order, outside excluded subtrees and without the model-owned marker."""
    return [
        entry
        for entry in _parameter_owners(model_parts).values()
        if entry[2] != _SKIP and not hasattr(entry[1], _MODEL_OWNED_GRAD_DIVISOR_ATTR)
    ]


def _unmarked_entries_by_name(
    model_parts: list[torch.nn.Module],
) -> list[tuple[_NameKey, torch.nn.Parameter, str]]:
    """:func:`_unmarked_entries` in rank-stable (model part index, smallest name) order."""
    return sorted(_unmarked_entries(model_parts), key=lambda entry: entry[0])


def _iter_unique_parameters(
    model_parts: list[torch.nn.Module],
) -> Iterator[tuple[torch.nn.Parameter, Literal["mean", "sum"]]]:
    """Yield unmarked parameters once with their module reduction semantic.

    "Unmarked" means neither in an excluded subtree nor carrying the model-owned attribute. The order
    is registration order, which may differ across ranks: use the ``_by_name`` variant for collectives.
    """
    for _, parameter, reduction in _unmarked_entries(model_parts):
        yield parameter, reduction


def _iter_unique_parameters_by_name(
    model_parts: list[torch.nn.Module],
) -> Iterator[tuple[torch.nn.Parameter, Literal["mean", "sum"]]]:
    """Yield parameters once in rank-stable fully qualified name order.

    The same parameters as :func:`_iter_unique_parameters`, sorted by (model part index, smallest fully
    qualified name), so every rank issues its collectives in the same order.
    """
    for _, parameter, reduction in _unmarked_entries_by_name(model_parts):
        yield parameter, reduction


def _iter_unique_buffers(model_parts: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """Yield model buffers once in rank-stable fully qualified name order.

    Buffers of excluded subtrees are left out; a shared buffer is keyed by its smallest name.
    """
    keys: dict[int, tuple[_NameKey, torch.Tensor]] = {}
    excluded: set[int] = set()
    for part_index, part in enumerate(model_parts):
        for module_name, module in part.named_modules(remove_duplicate=False):
            skipped = getattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, "mean") == _SKIP
            for local_name, buffer in module.named_buffers(recurse=False):
                if skipped:
                    excluded.add(id(buffer))
                key = (part_index, f"{module_name}.{local_name}" if module_name else local_name)
                seen = keys.get(id(buffer))
                keys[id(buffer)] = (key if seen is None else min(seen[0], key), buffer)
    for _, buffer in sorted((entry for bid, entry in keys.items() if bid not in excluded), key=lambda e: e[0]):
        yield buffer


def tp_replica_reduction(module: nn.Module) -> str:
    """The TP replica marker of ``module``: ``"mean"`` (also when unmarked), ``"sum"`` or ``"skip"``."""
    return getattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, "mean")


def unmarked_parameters(model_parts: list[nn.Module]) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every parameter outside excluded subtrees and without the model-owned
    marker, each once (a shared one under its smallest name), in rank-stable (part, name) order."""
    return [(key[1], parameter, reduction) for key, parameter, reduction in _unmarked_entries_by_name(model_parts)]


def tp_submesh(device_mesh: DeviceMesh | None, tp_axis_name: str = "tp") -> DeviceMesh | None:
    """The TP submesh of ``device_mesh`` when it has a TP axis of size > 1, else None (sliced once per mesh)."""
    context = _tp_context(device_mesh, tp_axis_name)
    return None if context is None else context.mesh


def tp_replicated_parameters(
    model_parts: list[nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every TP-replicated parameter, trainable or not, in rank-stable order.

    The parameters :func:`broadcast_tp_replicas` copies and, among those that require grad,
    :func:`synchronize_tp_replica_gradients` reduces. Empty without a TP axis of size > 1.
    """
    context = _tp_context(device_mesh, tp_axis_name)
    if context is None:
        return []
    return [
        (name, parameter, reduction)
        for name, parameter, reduction in unmarked_parameters(model_parts)
        if _is_tp_replicated(parameter, context.ranks, context.rank, tp_axis_name)
    ]


def _tp_group(tp_mesh: DeviceMesh) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    group = tp_mesh.get_group()
    return group, tuple(dist.get_process_group_ranks(group))


@torch.no_grad()
def broadcast_tp_replicas(
    model_parts: list[torch.nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> int:
    """Broadcast replicated parameters and buffers from the first TP rank.

    Call it once the model is built, parallelised and loaded, before creating the optimizer, so every
    TP rank starts from rank 0's copy (ranks may have initialised, loaded or been modified differently).
    Intended TP shards are excluded by their DTensor placement, and model-owned shards are excluded by
    their explicit parameter or module marker. The collective operates on each tensor's rank-local
    storage, whose shape is identical within a TP group even when another mesh axis shards the global
    tensor. Frozen and unused parameters are included; meta and empty tensors are skipped.

    Args:
        model_parts: Local pipeline-stage modules containing tensors of arbitrary shape. Shared tensors
            are visited once.
        device_mesh: Root mesh containing the tensor-parallel axis.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns:
        Number of rank-local tensors broadcast on this rank (0, with no collective, when there is no TP
        axis or it has size 1).
    """
    tp_mesh = _get_tp_mesh(device_mesh, tp_axis_name)
    if tp_mesh is None:
        return 0
    group, tp_ranks = _tp_group(tp_mesh)
    source = dist.get_global_rank(group, 0)
    rank = dist.get_rank()
    parameters = [parameter for parameter, _ in _iter_unique_parameters_by_name(model_parts)]
    count = 0
    for tensor in [*parameters, *_iter_unique_buffers(model_parts)]:
        if not _is_tp_replicated(tensor, tp_ranks, rank, tp_axis_name):
            continue
        local = _local_tensor(tensor)
        if local.is_meta or local.numel() == 0:
            continue
        wire = local if local.device.type == tp_mesh.device_type else local.to(tp_mesh.device_type)
        dist.broadcast(wire, src=source, group=group)
        if wire is not local:
            local.copy_(wire)
        count += 1
    return count


@torch.no_grad()
def synchronize_tp_replica_gradients(
    model_parts: list[torch.nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> int:
    """Reduce TP-replicated gradients once at the optimizer boundary.

    Call this exactly once per optimizer update, after gradient accumulation and before gradient
    scaling, norm calculation, clipping, or ``optimizer.step()``. Full-computation replicas are
    mean-reduced so each logical parameter has one optimizer update. Modules explicitly marked as
    producing disjoint partial contributions are sum-reduced, which makes repeated synchronization
    within one update non-idempotent. Gradients are flattened into bounded buffers by reduction, device,
    and dtype before communication. DTensor gradients are reduced through rank-local storage while
    retaining their global shape and placements. Model-owned shards and parameters or gradients sharded
    or partial on the TP axis are untouched. Low-precision gradients are reduced in FP32 and cast back to
    their storage dtype after synchronization.

    Args:
        model_parts: Local pipeline-stage modules whose gradients have arbitrary shapes and have
            completed accumulation for this optimizer update.
        device_mesh: Root mesh containing the tensor-parallel axis.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns:
        Number of rank-local gradients synchronized on this rank (0, with no collective, when there is
        no TP axis or it has size 1).

    Raises:
        RuntimeError: If gradient presence differs across TP replicas, or if a replicated parameter has
            a sparse gradient that cannot be flattened without changing its representation. Every rank
            of the TP group raises together, before any gradient is changed.
    """
    context = _tp_context(device_mesh, tp_axis_name)
    if context is None:
        return 0
    plan = _sync_plan(model_parts, context, tp_axis_name)
    if not plan.parameters:
        return 0
    full = plan.full
    in_place = full is not None and full.gradients_are_views(plan.parameters)
    if not plan.snapshot.still_trainable():  # checked here, where the parameters were just read: a replica frozen
        plan, full, in_place = _sync_plan(model_parts, context, tp_axis_name, rebuild=True), None, False
        if not plan.parameters:
            return 0
    if in_place:  # every gradient is its bucket view: present, dense, eligible; the flags are known
        flags = plan.dense_device_flags.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=context.group)
        if torch.equal(flags, plan.expected_flags):
            return full.reduce(plan.parameters, full.views_in_order, context.group, context.size, in_place=True)
        grads = full.views_in_order  # another rank disagrees: raise below, or reduce what is eligible
    else:
        grads = list(map(_grad, plan.parameters))
        flags = _precheck_flags(plan, grads, context, tp_axis_name).to(context.mesh.device_type)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=context.group)
    if torch.equal(flags, plan.expected_flags):  # every gradient present, eligible and dense on every rank
        layout, local_grads = plan.full_layout(grads), _local_grads(plan, grads)
        if layout is None:
            layout = plan.layout(local_grads, list(range(len(grads))))
    else:
        eligible = _check_flags(plan, flags, context.size)
        local_grads = [local_tensor(g) if g is not None else None for g in grads]
        layout = plan.layout(local_grads, eligible)
    return layout.reduce(plan.parameters, local_grads, context.group, context.size)


# --- the cached plan -----------------------------------------------------------------------------

_grad = attrgetter("grad")
_layout = attrgetter("layout")
_dtype = attrgetter("dtype")


class _TpContext(NamedTuple):
    mesh: DeviceMesh
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    rank: int
    size: int


_TP_CONTEXTS: dict[tuple[int, str], tuple[weakref.ref, _TpContext | None]] = {}


def _tp_context(device_mesh: DeviceMesh | None, tp_axis_name: str) -> _TpContext | None:
    """The TP submesh, its group and ranks, sliced once per (mesh, axis) instead of at every step."""
    if device_mesh is None:
        return None
    key = (id(device_mesh), tp_axis_name)
    cached = _TP_CONTEXTS.get(key)
    if cached is not None and cached[0]() is device_mesh:
        return cached[1]
    tp_mesh = _get_tp_mesh(device_mesh, tp_axis_name)
    context = None
    if tp_mesh is not None:
        group, ranks = _tp_group(tp_mesh)
        context = _TpContext(tp_mesh, group, ranks, dist.get_rank(), len(ranks))
    _TP_CONTEXTS[key] = (weakref.ref(device_mesh), context)
    return context


class _SyncPlan:
    """Candidates of one model for one TP group, in rank-stable order, and their bucket layouts."""

    def __init__(self, model_parts: list[nn.Module], context: _TpContext, tp_axis_name: str, max_bytes: int):
        self.snapshot = ModelSnapshot(model_parts, _TP_REPLICA_GRAD_REDUCTION_ATTR, _MODEL_OWNED_GRAD_DIVISOR_ATTR)
        self.part_refs = [weakref.ref(part) for part in model_parts]
        self.context, self.max_bytes = context, max_bytes
        replicas = [
            (key[1], parameter, reduction)
            for key, parameter, reduction in _unmarked_entries_by_name(model_parts)
            if _is_tp_replicated(parameter, context.ranks, context.rank, tp_axis_name)
        ]
        candidates = [entry for entry in replicas if entry[1].requires_grad]
        frozen = [parameter for _, parameter, _ in replicas if not parameter.requires_grad]  # they may thaw
        self.snapshot.watch([parameter for _, parameter, _ in candidates], frozen)
        self.names = [name for name, _, _ in candidates]
        self.parameters = [parameter for _, parameter, _ in candidates]
        self.reductions = [reduction for _, _, reduction in candidates]
        self.plain = [not isinstance(parameter, DTensor) for parameter in self.parameters]
        self.all_plain = all(self.plain)
        count = len(candidates)
        self.dense_flags = torch.tensor([[1] * count, [1] * count, [0] * count], dtype=torch.int32)
        self.dense_device_flags = self.dense_flags.to(context.mesh.device_type)
        self.expected_flags = (self.dense_flags * context.size).to(context.mesh.device_type)
        self._dtensor_indices = [index for index, plain in enumerate(self.plain) if not plain]
        self.full: BucketLayout | None = None  # the persistent layout, built at the first full step
        self._full_local_shapes: list[torch.Size] = []
        self._full_dtypes: list[torch.dtype] = []

    def matches(self, model_parts: list[nn.Module], context: _TpContext) -> bool:
        return (
            context is self.context
            and self.max_bytes == _MAX_FLAT_BUFFER_BYTES
            and len(model_parts) == len(self.part_refs)
            and all(ref() is part for ref, part in zip(self.part_refs, model_parts, strict=True))
            and self.snapshot.quick_valid(check_trainable=False)
        )

    def layout(self, local_grads: list[torch.Tensor | None], eligible: list[int]) -> BucketLayout:
        """A layout without persistent buffers, for an unusual step (gradients missing everywhere)."""
        device, bound = self.context.mesh.device_type, self.max_bytes
        return BucketLayout(local_grads, self.reductions, eligible, self.plain, device, bound, persistent=False)

    def full_layout(self, grads: list[torch.Tensor]) -> BucketLayout | None:
        """The persistent layout for "every candidate has a gradient"; None if DTensor local shapes moved."""
        shapes = [local_tensor(grads[i]).shape for i in self._dtensor_indices]
        dtypes = list(map(_dtype, grads))
        if self.full is None or dtypes != self._full_dtypes:  # first full step, or the model was cast
            self.full = None  # its buffers go before the new ones are made
            local_grads = _local_grads(self, grads)
            everyone = list(range(len(grads)))
            device = self.context.mesh.device_type
            self.full = BucketLayout(local_grads, self.reductions, everyone, self.plain, device, self.max_bytes)
            self._full_local_shapes, self._full_dtypes = shapes, dtypes
        return self.full if shapes == self._full_local_shapes else None


def _sync_plan(
    model_parts: list[nn.Module], context: _TpContext, tp_axis_name: str, rebuild: bool = False
) -> _SyncPlan:
    """The cached plan for these model parts, rebuilt when the modules, parameters or markers changed (the
    trainable replicas' ``requires_grad`` is left to the caller: :meth:`ModelSnapshot.still_trainable`)."""
    plans = model_cache(model_parts[0]).setdefault("replica_sync_plans", {}) if model_parts else {}
    key = (id(context.group), tp_axis_name)
    plan = plans.get(key)
    if rebuild or plan is None or not plan.matches(model_parts, context):
        plan = _SyncPlan(model_parts, context, tp_axis_name, _MAX_FLAT_BUFFER_BYTES)
        plans[key] = plan
    return plan


def _local_grads(plan: _SyncPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return grads if plan.all_plain else list(map(local_tensor, grads))


def _precheck_flags(plan: _SyncPlan, grads: list, context: _TpContext, tp_axis_name: str) -> torch.Tensor:
    """Per candidate [present, eligible, sparse], as one int32 tensor built at once."""
    if (
        plan.all_plain
        and not any(map(is_, grads, repeat(None)))
        and all(map(is_, map(_layout, grads), repeat(torch.strided)))
    ):
        return plan.dense_flags.clone()
    present, eligible, sparse = [], [], []
    for grad in grads:
        present.append(grad is not None)
        eligible.append(grad is not None and _is_tp_replicated(grad, context.ranks, context.rank, tp_axis_name))
        sparse.append(grad is not None and local_tensor(grad).layout != torch.strided)
    return torch.tensor([present, eligible, sparse], dtype=torch.int32)


def _check_flags(plan: _SyncPlan, flags: torch.Tensor, tp_size: int) -> list[int]:
    """Raise (on every rank alike) if the summed flags disagree; return the indices to reduce."""
    present, eligible, sparse = flags.cpu().tolist()

    def names(bad: list[bool]) -> str:
        return ", ".join(name for name, is_bad in zip(plan.names, bad, strict=True) if is_bad)

    if any(0 < count < tp_size for count in present):
        raise RuntimeError(f"Gradient presence differs across TP replicas: {names([0 < c < tp_size for c in present])}")
    if any(0 < count < tp_size for count in eligible):
        raise RuntimeError(
            f"Gradient placements differ across TP replicas: {names([0 < c < tp_size for c in eligible])}"
        )
    if any(sparse):
        raise RuntimeError(
            "Sparse gradients cannot be flattened for TP replica synchronization: "
            f"{names([count > 0 for count in sparse])}"
        )
    # no gradient anywhere, or Partial/Shard on TP: left exactly as it is
    return [index for index, count in enumerate(eligible) if count > 0]
