"""The differentiable collectives expert parallelism needs, each with the backward its layout calls
for.

Tokens entering an MoE block are the same on every rank of a TP group (replicated activations), and
the gradient that comes back to them is the same on every TP rank too. The pairs below follow from
that:

- :func:`sum_over_group` / :func:`enter_group`: the folded path's pair (Megatron's "g" and "f"): the
  forward sums the ranks' partial outputs, the backward of the entry sums the partial input
  gradients.
- :func:`scatter_rows` / :func:`gather_rows`: this rank's block of replicated rows, and back; the
  backward of taking a block is gathering the blocks' gradients, the backward of gathering is taking
  the block.
- :func:`all_to_all_rows`: rows to the ranks that hold their experts; its backward is the reverse
  exchange.
"""

import torch
import torch.distributed as dist

from components.distributed.collectives import all_gather_single


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _EnterGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        return hidden_states.view_as(hidden_states), weights.view_as(weights)

    @staticmethod
    def backward(ctx, hidden_grad: torch.Tensor, weights_grad: torch.Tensor):
        # One collective for both, summed in FP32 whatever the activations' dtype.
        flat = torch.cat([hidden_grad.reshape(-1).float(), weights_grad.reshape(-1).float()])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
        hidden, weights = flat.split([hidden_grad.numel(), weights_grad.numel()])
        hidden, weights = hidden.view_as(hidden_grad), weights.view_as(weights_grad)
        return hidden.to(hidden_grad.dtype), weights.to(weights_grad.dtype), None


def sum_over_group(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Forward: all-reduce SUM of the ranks' partial outputs. Backward: identity (the same gradient
    everywhere)."""
    return _SumOverGroup.apply(partial, group)


def enter_group(hidden_states: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup):
    """Forward: identity on replicated inputs. Backward: one all-reduce SUM of both inputs' partial
    gradients."""
    return _EnterGroup.apply(hidden_states, weights, group)


def block(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``rows`` split into ``size`` equal blocks (a view; no autograd of
    its own)."""
    per_rank = rows.shape[0] // size
    return rows[rank * per_rank : (rank + 1) * per_rank]


def _gather(block: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    gathered = block.new_empty((block.shape[0] * size, *block.shape[1:]))
    all_gather_single(gathered, block.contiguous(), group=group)
    return gathered


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
    ) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return block(rows, rank, size).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.group, ctx.size), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, block: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
    ) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        return _gather(block, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return block(grad, ctx.rank, ctx.size).clone(), None, None, None


def scatter_rows(
    rows: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
) -> torch.Tensor:
    """This rank's block of rows that every rank of ``group`` holds alike (``rows`` divisible by
    ``size``). Backward: the blocks' gradients gathered, so every rank gets the whole (identical)
    input gradient."""
    return _ScatterRows.apply(rows, group, rank, size)


def gather_rows(
    block: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int
) -> torch.Tensor:
    """Every rank's block, concatenated in rank order. Backward: this rank's block of the
    (identical) gradient."""
    return _GatherRows.apply(block, group, rank, size)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup
    ):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def exchange(
    rows: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """One all-to-all without autograd: ``send[r]`` leading rows go to rank r, ``receive[r]`` rows
    come from it."""
    received = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), receive, send, group=group)
    return received


def all_to_all_rows(
    rows: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """:func:`exchange` with autograd: the gradient of the received rows goes back to where they
    came from."""
    return _AllToAllRows.apply(rows, send, receive, group)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Forward: identity. Backward: the gradient times ``factor``."""
    return _ScaleGradient.apply(tensor, factor)
