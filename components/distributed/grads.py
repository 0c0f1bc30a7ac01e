"""Gradient finalisation for DTensor models, a global grad norm that counts every replica once,
clipping.

The order at each optimizer step is: :func:`finalize_dtensor_gradients` (Partial -> Replicate, so
each gradient has its parameter's placement) -> ``synchronize_tp_replica_gradients`` ->
:func:`clip_grad_norm_` (or :func:`grad_norm`) -> ``optimizer.step()``.

``torch.nn.utils.clip_grad_norm_`` cannot mix plain tensors with DTensors on different meshes, and a
naive sum over every rank counts a TP replica ``tp`` times. Here each gradient's squared norm is
reduced only over the mesh dimensions on which it is *sharded*; replicated dimensions and plain
tensors (full copies on every rank) contribute once.
"""

import math
from operator import attrgetter, itemgetter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from components.distributed.replicas.flat_buffers import (
    MAX_FLAT_BUFFER_BYTES,
    bounded_chunks,
    local_tensor,
    pack,
    unpack,
    wire_dtype,
)

_grad = attrgetter("grad")
_first = itemgetter(0)
# Elements per float64 staging chunk of the exact sum of squares: 2 MiB, cache-sized (measured
# fastest of 2^15 to 2^20 on SmolLM2's gradients at 1 thread; BENCHMARKS.md, "Step overhead").
SQUARES_CHUNK = 1 << 18


def named_trainable(model_parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters that require grad, each once, in rank-stable (part, name) order, named
    ``name`` in the first part and ``part:name`` in the others.

    Walked at every call, nothing kept: about 1 ms for 1,000 parameters, small beside a step.
    """
    trainable: dict[nn.Parameter, str] = {}  # insertion-ordered, keyed by the parameter itself
    for index, part in enumerate(model_parts):
        for name, parameter in sorted(part.named_parameters(), key=_first):
            if parameter.requires_grad:
                trainable.setdefault(parameter, f"{index}:{name}" if index else name)
    return [(name, parameter) for parameter, name in trainable.items()]


def _trainable_parameters(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    return [parameter for _, parameter in named_trainable(model_parts)]


def _any_dtensor(parameters: list[nn.Parameter]) -> bool:
    return any(isinstance(parameter, DTensor) for parameter in parameters)


def _partial_to_replicate_dims(grad: DTensor, target: tuple) -> tuple[int, ...] | None:
    """Mesh dims where a sum-Partial gradient must become Replicate; None if any other change is
    needed."""
    dims = []
    for dim, (have, want) in enumerate(zip(grad.placements, target, strict=True)):
        if have == want:
            continue
        if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate):
            dims.append(dim)
        else:
            return None
    return tuple(dims)


def check_partial_candidates_present(model_parts: list[nn.Module]) -> None:
    """Raise on every rank, naming them, if DTensor parameters that may hold Partial gradients have
    a gradient on some ranks of their mesh and not on others (a parameter unused by one rank's
    forward): the flat all-reduce below would otherwise mismatch (a hang or an abort) or silently
    mix gradients."""
    by_mesh: dict[DeviceMesh, list[tuple[str, bool]]] = {}
    for part_index, part in enumerate(model_parts):
        for name, parameter in sorted(part.named_parameters(), key=lambda item: item[0]):
            if isinstance(parameter, DTensor) and any(
                isinstance(p, Replicate) for p in parameter.placements
            ):
                by_mesh.setdefault(parameter.device_mesh, []).append(
                    (f"{part_index}:{name}" if part_index else name, parameter.grad is not None)
                )
    for (
        mesh,
        entries,
    ) in by_mesh.items():  # first-appearance order in name order: the same on every rank
        present = torch.tensor(
            [has for _, has in entries], dtype=torch.int32, device=mesh.device_type
        )
        for dim in range(mesh.ndim):
            dist.all_reduce(present, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        differing = [
            name
            for (name, _), count in zip(entries, present.tolist(), strict=True)
            if 0 < count < mesh.size()
        ]
        if differing:
            raise RuntimeError(f"Gradient presence differs across ranks: {', '.join(differing)}")


# A group of Partial gradients summed together: (mesh, dims, dtype, device), and its members as
# (name, parameter) in rank-stable order.
PartialGroups = dict[tuple, list[tuple[str, nn.Parameter]]]


def sort_gradients(named: list[tuple[str, nn.Parameter]]) -> tuple[PartialGroups, int]:
    """Group the sum-Partial gradients that must become Replicate by (mesh, dims, dtype, device);
    redistribute any other gradient whose placements differ from its parameter's (a collective
    each). Returns the groups and how many gradients were redistributed."""
    groups: PartialGroups = {}
    redistributed = 0
    for name, parameter in named:
        grad = parameter.grad
        if not isinstance(grad, DTensor) or grad.placements == parameter.placements:
            continue
        dims = _partial_to_replicate_dims(grad, parameter.placements)
        if dims is None:
            parameter.grad = grad.redistribute(grad.device_mesh, parameter.placements)
            redistributed += 1
            continue
        key = (grad.device_mesh, dims, grad.dtype, grad._local_tensor.device)
        groups.setdefault(key, []).append((name, parameter))
    return groups, redistributed


def sum_group(key: tuple, locals_: list[torch.Tensor]) -> None:
    """Sum ``locals_`` in place over the group's mesh dims: flat buffers of bounded size, one
    all-reduce per dim and chunk, one chunk's buffer alive at a time."""
    mesh, dims, dtype, _ = key
    for chunk in bounded_chunks(locals_, MAX_FLAT_BUFFER_BYTES):
        flat = pack(chunk, wire_dtype(dtype), chunk[0].device)
        for dim in dims:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        unpack(flat, chunk)
        del flat


def replicated(grad: DTensor, parameter: nn.Parameter) -> DTensor:
    """``grad``'s local storage (summed) as a DTensor of the parameter's placements."""
    return DTensor.from_local(
        grad._local_tensor,
        parameter.device_mesh,
        parameter.placements,
        run_check=False,
        shape=grad.shape,
        stride=grad.stride(),
    )


def sum_partial_groups(groups: PartialGroups) -> int:
    """Sum each group's gradients and give them their parameters' placements; return how many."""
    for key, members in groups.items():
        sum_group(key, [parameter.grad._local_tensor for _, parameter in members])
        for _, parameter in members:
            parameter.grad = replicated(parameter.grad, parameter)
    return sum(map(len, groups.values()))


@torch.no_grad()
def finalize_dtensor_gradients(model_parts: list[nn.Module]) -> int:
    """Give every DTensor gradient its parameter's placements; return how many gradients changed.

    Sequence-parallel norms (and any Replicate parameter used on sharded activations) get
    ``Partial`` gradients: each rank holds a part of the sum. These are summed in flat buffers, one
    all-reduce per (mesh, dims, dtype) group and bounded chunk, instead of one collective per
    tensor. Any other placement mismatch falls back to ``DTensor.redistribute``. Call once per
    optimizer step, after gradient accumulation. Reads the device once, the presence check before
    the buffers move; ``components/distributed/step_finalizer.py`` learns a run's gradients at its
    first step and finalises the later ones without reading.
    """
    named = named_trainable(model_parts)
    if not _any_dtensor([parameter for _, parameter in named]):
        return 0  # plain tensors only (tp=1 without FSDP): nothing to finalise, no collective
    check_partial_candidates_present(model_parts)
    groups, redistributed = sort_gradients(named)
    return redistributed + sum_partial_groups(groups)


def _norm_group_key(grad: torch.Tensor) -> tuple:
    """Gradients that share a mesh layout and sharded dims reduce together; plain tensors never
    reduce."""
    if not isinstance(grad, DTensor):
        return ("plain",)
    if any(isinstance(p, Partial) for p in grad.placements):
        raise ValueError(
            "grad_norm needs finalised gradients: call finalize_dtensor_gradients first"
        )
    mesh = grad.device_mesh
    sharded = tuple(
        dim for dim, p in enumerate(grad.placements) if not isinstance(p, Replicate)
    )  # strided too
    return (mesh.mesh_dim_names, tuple(mesh.shape), sharded)  # not .mesh: reads its ranks


def _reduce_norms(
    norms: list[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """Combine per-tensor float64 norms into the group's max (inf) or sum of p-th powers, on
    ``device`` (the gradients'): nothing here waits for it."""
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if norm_type == math.inf else stacked.pow(norm_type).sum()


def _local_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-tensor norms of rank-local gradients, accumulated in float64 without a float64 copy."""
    return list(torch._foreach_norm(grads, norm_type, dtype=torch.float64)) if grads else []


def float64_sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of contiguous CPU tensors, as a float64 scalar:
    each element widened to float64 (so its square is exact for fp32, bf16 and fp16) in chunks of
    :data:`SQUARES_CHUNK` that stay in cache, squared and summed there by one BLAS dot.

    Same float64 arithmetic as ``_foreach_norm(..., dtype=torch.float64)`` followed by squaring
    the norms, in another order, without its per-tensor square roots; 2.5-3x faster on this CPU.
    """
    staging = torch.empty(min(SQUARES_CHUNK, max(map(torch.numel, grads))), dtype=torch.float64)
    sums = [torch.zeros((), dtype=torch.float64)]
    for grad in grads:
        for chunk in grad.view(-1).split(SQUARES_CHUNK):
            wide = staging[: chunk.numel()]
            wide.copy_(chunk)
            sums.append(torch.dot(wide, wide))
    return torch.stack(sums).sum()


def _local_total(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The max (inf) or sum of p-th powers of rank-local gradients, float64, on ``device``.

    The 2-norm of contiguous CPU gradients is summed by :func:`float64_sum_of_squares` (each
    square exact, 2.5-3x faster there than per-tensor float64 norms); the rest (other p, other
    devices, where ``_foreach_norm`` is one fused kernel, non-contiguous storage) as before.
    """
    fast = [g for g in grads if norm_type == 2.0 and g.device.type == "cpu" and g.is_contiguous()]
    if not fast:
        return _reduce_norms(_local_norms(grads, norm_type), norm_type, device)
    total = float64_sum_of_squares(fast)
    if len(fast) == len(grads):
        return total
    fast_ids = set(map(id, fast))
    rest = [g for g in grads if id(g) not in fast_ids]
    return total + _reduce_norms(_local_norms(rest, norm_type), norm_type, device)


@torch.no_grad()
def grad_norm(
    model_parts: list[nn.Module], norm_type: float = 2.0, across: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global gradient norm, equal on every rank, as if the whole model were on one device.
    ``across``: the group of ranks that hold the other parts of the model (pipeline stages, each
    parameter on one of them), over which the norms combine too.

    ``norm_type`` is any p > 0 or ``inf``; every element's p-th power is accumulated in float64
    (:func:`_local_total`) and so is the sum. Call after finalisation and the replica sync; the
    result is a float64 scalar on the gradients' device, not read here (no host synchronisation).
    """
    norm_type = float(norm_type)
    trainable = _trainable_parameters(model_parts)
    grads = list(map(_grad, trainable))
    device = local_tensor(trainable[0]).device if trainable else torch.device("cpu")
    if not _any_dtensor(trainable):  # plain tensors: full copies on every rank, nothing to reduce
        present = [g for g in grads if g is not None]
        total = _combined(_local_total(present, norm_type, device), norm_type, across)
        return total if norm_type == math.inf else total.pow(1.0 / norm_type)
    is_inf = norm_type == math.inf
    locals_: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, DeviceMesh | None] = {}
    for parameter, grad in zip(trainable, grads, strict=True):
        # A missing gradient counts as zero but still names its group, so every rank reduces the
        # same groups even when one rank's copy of a parameter (an unused expert) got no gradient.
        key = _norm_group_key(grad if grad is not None else parameter)
        source = grad if grad is not None else parameter
        meshes.setdefault(key, source.device_mesh if isinstance(source, DTensor) else None)
        if grad is not None:
            locals_.setdefault(key, []).append(local_tensor(grad).detach())

    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    totals = [torch.zeros((), dtype=torch.float64, device=device)]
    for key in sorted(meshes, key=repr):  # every rank reduces the same groups in the same order
        value = _local_total(locals_.get(key, []), norm_type, device)
        mesh = meshes[key]
        if mesh is not None and key[2]:
            wire = value.reshape(1)  # on the device: the mesh's own backend reduces it
            for dim in key[2]:
                dist.all_reduce(wire, op=op, group=mesh.get_group(dim))
            value = wire.reshape(())
        totals.append(value)
    stacked = torch.stack(totals)
    total = _combined(stacked.max() if is_inf else stacked.sum(), norm_type, across)
    return total if is_inf else total.pow(1.0 / norm_type)


def _combined(total: torch.Tensor, norm_type: float, across: dist.ProcessGroup | None):
    """This rank's max (inf) or sum of p-th powers combined with ``across``'s ranks' (None: as
    it is)."""
    if across is None:
        return total
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    wire = total.reshape(1).clone()
    dist.all_reduce(wire, op=op, group=across)
    return wire.reshape(())


@torch.no_grad()
def clip_grad_norm_(
    model_parts: list[nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    across: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``; return the norm before
    clipping (on the device, unread: the coefficient is computed and applied there, so clipping
    never waits for the device); ``across``: as in :func:`grad_norm`.

    The coefficient is ``max_norm / (norm + 1e-6)`` in float64, used where below 1 and 1 otherwise
    (a non-finite norm's NaN too, as Python's ``min(1.0, nan)``); multiplying by 1 changes no
    finite gradient, so an unclipped step's gradients are bit-for-bit the unscaled ones."""
    total = grad_norm(model_parts, norm_type, across)
    limit = torch.full((), max_norm, dtype=torch.float64, device=total.device)
    ratio = limit / (total + 1e-6)  # a true division, as the float arithmetic it replaces
    coefficient = torch.where(ratio < 1.0, ratio, torch.ones_like(ratio))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in map(_grad, _trainable_parameters(model_parts)):
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(local_tensor(grad))
    for dtype, grads in by_dtype.items():  # cast first, as the Python number it replaces was
        torch._foreach_mul_(grads, coefficient.to(dtype))
    return total
