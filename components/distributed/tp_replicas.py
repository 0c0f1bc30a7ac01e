"""Keep the parameters TP does not shard identical on every rank of a TP group (the spec's API).

Under TP, norms, routers, q/k norms and small projections are full copies on every TP rank.
:func:`broadcast_tp_replicas` copies TP rank 0's once the model is built (after the TP plan and
weight loading, before the optimizer); :func:`synchronize_tp_replica_gradients` reduces their
gradients once per optimizer update, after accumulation and DTensor gradient finalisation, before
grad norm, clipping and ``optimizer.step()``: unmarked modules mean-reduced, modules marked
``"sum"`` sum-reduced (a second call per update is wrong). What counts as a replica, and in which
order, is ``replicas/selection.py``. Called once per step on the same model parts, the sync reuses
its plan and flat buffers (``replicas/plan.py``: kept with the model, checked by a structural
fingerprint at every call, rebuilt when the model changed). Every collective is made here, through
``dist.<name>`` at call time, so tests can intercept them. Where the specification is silent: owners
of a shared parameter that disagree are a ``ValueError``; a sparse gradient on any rank makes every
rank raise together; every rank of a TP group holds the same module structure.
"""

from collections.abc import Iterator
from operator import attrgetter
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.distributed.replicas.buckets import BucketLayout
from components.distributed.replicas.flat_buffers import bounded_chunks, local_tensor, wire_dtype
from components.distributed.replicas.plan import (
    Plan,
    TpGroup,
    bind_gradients,
    cached_plan,
    release_untouched_gradients,
    tp_group,
    tp_replicated_parameters,
)
from components.distributed.replicas.selection import (
    MODEL_OWNED_ATTR,
    REDUCTION_ATTR,
    REDUCTIONS,
    SKIP,
    get_tp_mesh,
    is_tp_replicated,
    tp_replica_reduction,
    unique_buffers,
    unmarked_entries,
)

__all__ = [
    "broadcast_tp_replicas",
    "exclude_from_tp_replica_sync",
    "mark_tp_replica_gradient_reduction",
    "synchronize_tp_replica_gradients",
    "tp_replica_reduction",
    "tp_replicated_parameters",
    "unmarked_parameters",
    "zero_tp_replica_gradients",
]

_TP_REPLICA_GRAD_REDUCTION_ATTR = REDUCTION_ATTR
_MODEL_OWNED_GRAD_DIVISOR_ATTR = MODEL_OWNED_ATTR
_MAX_FLAT_BUFFER_BYTES = 256 * 1024 * 1024  # read at call time: tests and callers may change it

_grad = attrgetter("grad")

# the spec's names for pieces that live beside the sync
_get_tp_mesh = get_tp_mesh
_is_tp_replicated = is_tp_replicated
_local_tensor = local_tensor


def mark_tp_replica_gradient_reduction(
    module: torch.nn.Module, reduction: Literal["mean", "sum"]
) -> None:
    """Mark direct parameters of a module with their TP-replica reduction semantic.

    Use ``"sum"`` where each TP rank saw a disjoint part of the work (a norm on head-sharded q/k, a
    router on sequence-sharded tokens); unmarked modules default to ``"mean"``. The marker is stored
    on the module and applies to its direct parameters only (``recurse=False``).

    Args:
        module: Module whose direct parameters are replicated across TP ranks.
        reduction: ``"mean"`` for redundant full computation or ``"sum"`` for disjoint partial
            contributions.

    Raises:
        ValueError: If ``reduction`` is neither ``"mean"`` nor ``"sum"``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"TP replica gradient reduction must be 'mean' or 'sum', got {reduction!r}"
        )
    setattr(module, REDUCTION_ATTR, reduction)


def exclude_from_tp_replica_sync(module: torch.nn.Module) -> None:
    """Exclude an owner-sharded module subtree from TP replica synchronization.

    Some parameter owners use a mesh that folds physical TP ranks into another logical axis (expert
    parallelism folded onto the TP ranks). Their local tensors are different shards, even though
    they are not DTensors carrying an explicit ``tp`` placement. Marking the complete subtree keeps
    both parameter and buffer synchronization from treating those owner-local tensors as TP
    replicas. Call it after the subtree is built: modules added below it later are not marked.

    Args:
        module: Owner-sharded module whose current subtree must remain local.
    """
    for submodule in module.modules():
        setattr(submodule, REDUCTION_ATTR, SKIP)


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


def _iter_unique_parameters(
    model_parts: list[torch.nn.Module],
) -> Iterator[tuple[torch.nn.Parameter, Literal["mean", "sum"]]]:
    """Yield unmarked parameters once with their module reduction semantic.

    "Unmarked" means neither in an excluded subtree nor carrying the model-owned attribute. The
    order is registration order, which may differ across ranks: use the ``_by_name`` variant for
    collectives.
    """
    for _, parameter, reduction in unmarked_entries(model_parts, by_name=False):
        yield parameter, reduction


def _iter_unique_parameters_by_name(
    model_parts: list[torch.nn.Module],
) -> Iterator[tuple[torch.nn.Parameter, Literal["mean", "sum"]]]:
    """Yield parameters once in rank-stable fully qualified name order.

    The same parameters as :func:`_iter_unique_parameters`, sorted by (model part index, smallest
    fully qualified name), so every rank issues its collectives in the same order.
    """
    for _, parameter, reduction in unmarked_entries(model_parts):
        yield parameter, reduction


def _iter_unique_buffers(model_parts: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """Yield model buffers once in rank-stable fully qualified name order.

    Buffers of excluded subtrees are left out; a shared buffer is keyed by its smallest name.
    """
    yield from unique_buffers(model_parts)


def unmarked_parameters(model_parts: list[nn.Module]) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, reduction) of every parameter outside excluded subtrees and without the
    model-owned marker, each once (a shared one under its smallest name), in rank-stable order."""
    return [
        (key[1], parameter, reduction)
        for key, parameter, reduction in unmarked_entries(model_parts)
    ]


@torch.no_grad()
def broadcast_tp_replicas(
    model_parts: list[torch.nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> int:
    """Broadcast replicated parameters and buffers from the first TP rank.

    Call it once the model is built, parallelised and loaded, before creating the optimizer, so
    every TP rank starts from rank 0's copy (ranks may have initialised, loaded or been modified
    differently). Intended TP shards are excluded by their DTensor placement, and model-owned shards
    are excluded by their explicit parameter or module marker. The collective operates on each
    tensor's rank-local storage, whose shape is identical within a TP group even when another mesh
    axis shards the global tensor. Frozen and unused parameters are included; meta and empty tensors
    are skipped.

    Args:
        model_parts: Local pipeline-stage modules containing tensors of arbitrary shape. Shared
            tensors are visited once.
        device_mesh: Root mesh containing the tensor-parallel axis.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns: Number of rank-local tensors broadcast on this rank (0, with no collective, when there
        is no TP axis or it has size 1).
    """
    tp = tp_group(device_mesh, tp_axis_name)
    if tp is None:
        return 0
    source = dist.get_global_rank(tp.group, 0)
    parameters = [parameter for _, parameter, _ in unmarked_entries(model_parts)]
    count = 0
    for tensor in [*parameters, *unique_buffers(model_parts)]:
        if not is_tp_replicated(tensor, tp.ranks, tp.rank, tp_axis_name):
            continue
        local = local_tensor(tensor)
        if local.is_meta or local.numel() == 0:
            continue
        on_wire = local.device.type == tp.mesh.device_type
        wire = local if on_wire else local.to(tp.mesh.device_type)
        dist.broadcast(wire, src=source, group=tp.group)
        if wire is not local:
            local.copy_(wire)
        count += 1
    return count


@torch.no_grad()
def zero_tp_replica_gradients(
    model_parts: list[torch.nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> int:
    """Give the trainable TP replicas zeroed slots of the sync's persistent buckets as gradients.

    Not in the spec: the recipe's step calls it after ``optimizer.zero_grad(set_to_none=True)``
    and before the backward, so autograd accumulates the replicas' gradients straight into the
    buckets (DDP's ``gradient_as_bucket_view``) and the next
    :func:`synchronize_tp_replica_gradients` on the same parts and mesh is the pre-check and one
    all-reduce per bucket, with no copy. That sync gives ``None`` back to every bound gradient the
    backward did not reach, so a parameter without a gradient still has none. It binds nothing
    (returns 0) before a first sync has built the buckets, when a bucket stages its gradients
    (bf16/fp16, DTensor, another device) or when a parameter no longer fits its slot (then every
    replica's gradient is ``None``, as ``zero_grad`` left it); a gradient replaced after it is
    packed by the sync as before.

    Returns: Number of gradients bound on this rank.
    """
    return bind_gradients(model_parts, device_mesh, tp_axis_name)


@torch.no_grad()
def synchronize_tp_replica_gradients(
    model_parts: list[torch.nn.Module], device_mesh: DeviceMesh | None, tp_axis_name: str = "tp"
) -> int:
    """Reduce TP-replicated gradients once at the optimizer boundary.

    Call this exactly once per optimizer update, after gradient accumulation and before gradient
    scaling, norm calculation, clipping, or ``optimizer.step()``. Full-computation replicas are
    mean-reduced so each logical parameter has one optimizer update. Modules explicitly marked as
    producing disjoint partial contributions are sum-reduced, which makes repeated synchronization
    within one update non-idempotent. Gradients are flattened into bounded buffers by reduction,
    device, and dtype before communication. DTensor gradients are reduced through rank-local storage
    while retaining their global shape and placements. Model-owned shards and parameters or
    gradients sharded or partial on the TP axis are untouched. Low-precision gradients are reduced
    in FP32 and cast back to their storage dtype after synchronization.

    Args:
        model_parts: Local pipeline-stage modules whose gradients have arbitrary shapes and have
            completed accumulation for this optimizer update.
        device_mesh: Root mesh containing the tensor-parallel axis.
        tp_axis_name: Name of the tensor-parallel mesh dimension.

    Returns: Number of rank-local gradients synchronized on this rank (0, with no collective, when
        there is no TP axis or it has size 1).

    Raises:
        RuntimeError: If gradient presence differs across TP replicas, or if a replicated parameter
            has a sparse gradient that cannot be flattened without changing its representation.
            Every rank of the TP group raises together, before any gradient is changed.
    """
    # bound by zero_tp_replica_gradients and not reached: None again; True if every one was reached
    every_bound_reached = release_untouched_gradients(model_parts)
    plan = cached_plan(model_parts, device_mesh, tp_axis_name, _MAX_FLAT_BUFFER_BYTES)
    if plan is None or not plan.parameters:
        return 0
    full = plan.full
    in_place = full is not None and full.gradients_are_views(plan.parameters)
    # every bound slot the backward reached and every gradient still its slot: each replica
    # required grad in that backward; otherwise read it here, just after their gradients
    if not (in_place and every_bound_reached) and not plan.fingerprint.still_trainable():
        plan = cached_plan(model_parts, device_mesh, tp_axis_name, plan.max_bytes, rebuild=True)
        full, in_place = None, False
        if plan is None or not plan.parameters:
            return 0
    tp = plan.tp
    if in_place:  # every gradient is its bucket view: present, dense, eligible; flags known
        flags = plan.dense_device_flags.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=tp.group)
        if torch.equal(flags, plan.expected_flags):
            return _reduce(full, plan.parameters, full.views_in_order, tp, in_place=True)
        grads = full.views_in_order  # another rank disagrees: raise below, or reduce the eligible
    else:
        grads = list(map(_grad, plan.parameters))
        flags = plan.precheck_flags(grads).to(tp.mesh.device_type)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=tp.group)
    layout, local_grads = _checked_layout(plan, flags, grads)
    return _reduce(layout, plan.parameters, local_grads, tp)


def _checked_layout(plan: Plan, flags: torch.Tensor, grads: list) -> tuple[BucketLayout, list]:
    """The layout to reduce with, once the summed pre-check flags are known (raising on every rank
    alike where they disagree), and the gradients' rank-local storage."""
    if torch.equal(flags, plan.expected_flags):  # every gradient present, eligible and dense
        local_grads = plan.local_grads(grads)
        layout = plan.full_layout(local_grads)
        if layout is None:
            layout = plan.layout(local_grads, list(range(len(grads))))
        return layout, local_grads
    eligible = plan.check_flags(flags)
    local_grads = [None if grad is None else local_tensor(grad) for grad in grads]
    return plan.layout(local_grads, eligible), local_grads


def _reduce(
    layout: BucketLayout,
    parameters: list[nn.Parameter],
    local_grads: list,
    tp: TpGroup,
    in_place: bool = False,
) -> int:
    """SUM all-reduce each bucket the layout hands out, then divide a mean's; the number reduced.

    Mean is SUM then divide (not ``ReduceOp.AVG``), the same on every backend; over a power-of-two
    TP size by the exact reciprocal, which rounds exactly like the division and is cheaper.
    """
    scale = 1.0 / tp.size if tp.size & (tp.size - 1) == 0 else None
    for flat, reduction in layout.exchange(parameters, local_grads, in_place):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp.group)
        if reduction == "mean":
            if scale is None:
                flat.div_(tp.size)
            else:
                flat.mul_(scale)
    return layout.count
