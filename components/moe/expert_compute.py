"""A rank's local experts on the rows routed to them, as transformers' fused experts module
computes them (``gate, up = (x @ gate_up[e].T).chunk(2)``, then ``(act_fn(gate) * up) @
down[e].T``; GPT-OSS's transposed weights, biases and clamped gate too), with per-expert adapters:
in two ``torch._grouped_mm`` calls wherever :func:`grouped_mm_fits`, else a loop over the experts.
Used by expert parallelism (``expert_parallel.py``) and by LoRA on unsplit experts.

Design notes: docs/design-notes.md
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from components.moe.expert_lora import LowRank, adapted


def _linear(rows: torch.Tensor, weight: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """One expert's projection: its weight stored [out, in], or [in, out] when the module's
    weights are transposed (GPT-OSS)."""
    return rows @ weight if getattr(experts, "is_transposed", False) else F.linear(rows, weight)


def _gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The gated activation of the module's own ``_apply_gate`` (GPT-OSS: interleaved rows and a
    clamped SwiGLU), else ``act_fn(gate) * up`` of concatenated halves."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def run_experts(
    experts: nn.Module,
    rows,
    expert_of_row,
    gate_up,
    down,
    weight_of_row=None,
    low_rank=None,
    biases=(),
) -> torch.Tensor:
    """Each local expert on its rows (``expert_of_row`` in ``[0, len(gate_up))``), returned in the
    rows' order and dtype, times ``weight_of_row`` when given; with ``low_rank`` (the local
    experts' adapters, :class:`LowRank`) each expert weight gains its low-rank term; ``biases``:
    the local experts' ``gate_up_proj_bias`` and ``down_proj_bias`` (GPT-OSS), or none.

    Grouped GEMM (:func:`run_experts_grouped`) wherever :func:`grouped_mm_fits`; the per-expert
    loop (:func:`run_experts_loop`) runs only where that predicate is false. No row at all: tied
    zeros."""
    if rows.shape[0] == 0:
        return tied_zeros(rows, gate_up, down, low_rank, biases)
    fits = grouped_mm_fits(rows, gate_up, down, low_rank)
    run = run_experts_grouped if fits else run_experts_loop
    return run(experts, rows, expert_of_row, gate_up, down, weight_of_row, low_rank, biases)


def tied_zeros(rows, gate_up, down, low_rank: LowRank | None = None, biases=()) -> torch.Tensor:
    """Zeros shaped like ``rows`` and tied to every local weight (biases and adapters too): every
    rank then runs each backward collective, and idle experts get zero (not missing) gradients,
    as in one process."""
    weights = (gate_up, down, *biases, *(low_rank.tensors() if low_rank is not None else ()))
    return rows * 0.0 + sum(weight.sum() for weight in weights) * 0.0


def run_experts_loop(
    experts, rows, expert_of_row, gate_up, down, weight_of_row=None, low_rank=None, biases=()
):
    """One pair of matmuls per local expert, each behind a ``torch.where`` (a host sync on GPU)."""
    output = tied_zeros(rows, gate_up, down, low_rank, biases)
    linear = functools.partial(_linear, experts=experts)
    for local in range(gate_up.shape[0]):
        selected = torch.where(expert_of_row == local)[0]
        if selected.numel() == 0:
            continue
        lora = low_rank.at(local) if low_rank is not None else None
        gate_up_rows = adapted(linear, rows[selected], gate_up[local], lora, "gate_up")
        gate_up_rows = gate_up_rows + biases[0][local] if biases else gate_up_rows
        result = adapted(linear, _gate(experts, gate_up_rows), down[local], lora, "down")
        result = result + biases[1][local] if biases else result
        if weight_of_row is not None:
            result = result * weight_of_row[selected, None]
        output = output.index_add(0, selected, result.to(output.dtype))
    return output


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes in: autocast's when it is on (``_grouped_mm`` has no
    autocast rule, so the grouped path casts by itself), else the rows'."""
    if torch.is_autocast_enabled(rows.device.type):
        return torch.get_autocast_dtype(rows.device.type)
    return rows.dtype


def grouped_mm_fits(
    rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, low_rank: LowRank | None = None
) -> bool:
    """Whether ``torch._grouped_mm`` can run these experts (and their adapters): the one place the
    loop is kept.

    ``_grouped_mm`` has kernels on CPU (torch >= 2.9) and CUDA (SM80+), for fp32, bf16 and fp16;
    each row stride (H, I and an adapter's rank) must be a multiple of 16 bytes and the weights
    16-byte aligned. Under ``torch.compile`` its meta function accepts bf16 only.
    """
    dtype, device = _compute_dtype(rows), gate_up.device
    compiling = torch.compiler.is_compiling()
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES:
        return False
    if device.type not in ("cpu", "cuda") or (compiling and dtype != torch.bfloat16):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    alignment = 16 // dtype.itemsize
    adapters = low_rank.tensors() if low_rank is not None else ()
    weights = (gate_up, down, *adapters)
    sizes = (*gate_up.shape[1:], *down.shape[1:], *(adapter.shape[-1] for adapter in adapters))
    if any(size % alignment for size in sizes):  # H, I (either way round) and the rank
        return False
    return compiling or all(weight.data_ptr() % 16 == 0 for weight in weights)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: the backward of
    ``_grouped_mm`` rejects the stride-0 gradient that a ``sum`` or ``expand`` downstream gives."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


def _grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool = False
):
    """``F.linear(rows of group e, weight[e])`` for every expert ``e`` (``rows @ weight[e]`` when
    ``transposed``), in one ``_grouped_mm``."""
    weight = weight if transposed else weight.transpose(-2, -1)
    product = torch._grouped_mm(rows, weight, offs=offsets)
    return _ContiguousGradient.apply(product)


def run_experts_grouped(
    experts, rows, expert_of_row, gate_up, down, weight_of_row=None, low_rank=None, biases=()
):
    """All local experts in two grouped GEMMs: the rows sorted by expert once, each group's end
    found by a fixed-size ``searchsorted`` (no host sync), the results put back in row order.

    As the HF experts module: ``gate, up = (x @ gate_up[e].T).chunk(2)``, then
    ``(act_fn(gate) * up) @ down[e].T``. ``_grouped_mm`` is differentiable in both operands and
    gives an expert with no rows exact zero gradients; its output depends on the whole 3-D
    weights, so every rank still runs each backward collective, as with the loop's tie.
    """
    dtype = _compute_dtype(rows)
    order = torch.argsort(expert_of_row, stable=True)
    sorted_experts = expert_of_row[order]
    ids = torch.arange(gate_up.shape[0], device=rows.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, ids, right=True, out_int32=True)
    linear = functools.partial(_grouped_linear, offsets=offsets)
    linear = functools.partial(linear, transposed=getattr(experts, "is_transposed", False))
    lora = low_rank.to(dtype) if low_rank is not None else None
    gate_up_rows = adapted(linear, rows[order].to(dtype), gate_up.to(dtype), lora, "gate_up")
    gate_up_rows = gate_up_rows + biases[0][sorted_experts] if biases else gate_up_rows
    result = adapted(linear, _gate(experts, gate_up_rows), down.to(dtype), lora, "down")
    result = result + biases[1][sorted_experts] if biases else result
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    result = result[inverse]
    if weight_of_row is not None:
        result = result * weight_of_row[:, None]
    return result.to(rows.dtype)
