"""One micro-batch: forward, a loss that works on vocab-sharded logits, backward; and evaluation.

Callers pass a :class:`components.data.loader.Batch`'s tensors: ``input_ids``, ``labels`` and, for
packed rows, ``position_ids`` that restart at each example (Hugging Face models keep attention
inside each example when positions restart and no attention mask is given). With context
parallelism (a :class:`~components.distributed.context_parallel.ContextParallel`) every cp rank is
given the whole micro-batch and computes its own share of it, and its own tokens' loss.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.distributed.chunked_loss import (
    LOSS_CHUNK_TOKENS,
    HeadWeights,
    chunked_cross_entropy_sum,
    chunks_head,
    head_weights,
    lm_head_skipped,
)
from components.distributed.context_parallel import ContextParallel, CpShard, running
from components.distributed.tp_plan import cross_entropy_sum
from components.moe.load_balance import load_balancing_loss


def model_inputs(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    cp: ContextParallel | None,
) -> tuple[dict, torch.Tensor, CpShard | None]:
    """The model's keyword arguments, the labels the loss reads, and this rank's :class:`CpShard`
    under ``cp`` (its share of the tokens, its targets already shifted over the whole sequence)."""
    # Position ids are always explicit: under sequence parallelism the model sees a shard of the
    # sequence and would derive them from the shard's length. No attention mask: padding is on the
    # right and masked out of the labels, which causal attention allows, and a mask would hide
    # packed examples' boundaries.
    if position_ids is None:
        batch, seq = input_ids.shape
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    if cp is None:
        return {"input_ids": input_ids, "position_ids": position_ids}, labels, None
    shard = cp.shard(input_ids, labels, position_ids)
    return shard.model_inputs(), shard.targets, shard


def _losses(
    model: nn.Module,
    inputs: dict,
    labels: torch.Tensor,
    shifted: bool,
    chunk_tokens: int | None,
    real: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed token loss of ``labels`` (``shifted``: already the targets, as under cp), and the
    model's load-balancing loss over the ``real`` tokens when its config asks for one
    (``components.moe.load_balancing_loss``).

    ``chunk_tokens`` > 0: the model's forward stops at the hidden states, and the head and the loss
    run that many tokens at a time (``components.distributed.chunked_loss``) for the families it
    applies to; 0 or None: the whole micro-batch's logits, then ``cross_entropy_sum``."""
    # No cache: Hugging Face looks for restarting positions (packed examples) only when there is
    # none.
    if chunk_tokens and chunks_head(model):
        outputs, weights = last_hidden_states(model, inputs)
        loss = chunked_cross_entropy_sum(
            outputs.logits, weights.weight, labels, chunk_tokens, shifted, weights.adapter
        )
        return loss, load_balancing_loss(model, outputs, real)
    outputs = model(**inputs, use_cache=False)
    loss = cross_entropy_sum(outputs.logits, labels, shifted)
    return loss, load_balancing_loss(model, outputs, real)


def last_hidden_states(model: nn.Module, inputs: dict) -> tuple[Any, HeadWeights]:
    """``model``'s own forward on ``inputs`` up to its decoder's last hidden states (the outputs'
    ``logits``; an MoE model's ``aux_loss`` beside them), and its head's weights for a chunked
    loss (a model :func:`chunks_head` accepts)."""
    with lm_head_skipped(model) as head:
        outputs = model(**inputs, use_cache=False)
    return outputs, head_weights(head)  # after the forward: FSDP's root holds the head unsharded


def _whole(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor on this rank's device (a DTensor's full value), detached."""
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()


def forward_backward_on_device(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    global_tokens: int,
    position_ids: torch.Tensor | None = None,
    compute: AbstractContextManager | None = None,
    aux_loss_weight: float = 0.0,
    loss_chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
    cp: ContextParallel | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one micro-batch and accumulate gradients; return its summed token loss (not normalised;
    under ``cp`` this rank's tokens' part: the sum over the cp group is the micro-batch's), a 0-dim
    tensor on the model's device: reading it is the caller's choice (the recipe reads a step's
    losses once, with its other metrics), so the micro-batch loop never waits for the device.

    The loss is divided by ``global_tokens`` (labelled tokens in the whole global batch, over every
    micro-batch and dp rank: ``StepBatches.labels_in_step``) before backward, so accumulated and
    dp-summed gradients equal the gradient of the global mean loss. ``position_ids`` None means ``0
    .. seq - 1``. ``compute`` wraps the forward and the loss only (the precision's autocast;
    backward runs outside it). An MoE model whose config sets ``output_router_logits`` also returns
    its load-balancing loss over the ``real`` tokens ([rows, positions], ``Batch.real_mask``; None:
    every position); it joins the backward times ``aux_loss_weight``
    (``components.moe.router_aux_loss_weight``). ``loss_chunk_tokens``: tokens per chunk of the head
    and loss (``train.loss_chunk_tokens``; see ``_losses``). ``cp``: this rank's context-parallel
    group; the gradients are then summed over it as over dp (FSDP over dp × cp).
    """
    inputs, labels, shard = model_inputs(input_ids, labels, position_ids, cp)
    # the backward of a vocab-parallel loss, and of a cp shard, must run inside them too
    with loss_parallel(), running(shard):
        with compute or nullcontext():
            shifted, chunk = cp is not None, loss_chunk_tokens
            loss_sum, aux_loss = _losses(model, inputs, labels, shifted, chunk, real)
        objectives = [loss_sum / global_tokens]
        if aux_loss_weight and aux_loss is not None:
            objectives.append(aux_loss * aux_loss_weight)
        torch.autograd.backward(objectives)
    return _whole(loss_sum)


def forward_backward(*args, **kwargs) -> float:
    """:func:`forward_backward_on_device` (the same arguments), its loss read on the host: a wait
    for the device per call, for callers that want the number at once (tests, scripts); the recipe's
    micro-batch loop keeps the tensor and reads a step's losses once."""
    return forward_backward_on_device(*args, **kwargs).item()


@torch.no_grad()
def evaluate_loss_sum(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    compute: AbstractContextManager | None = None,
    loss_chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
    cp: ContextParallel | None = None,
) -> float:
    """Summed token loss of one batch, without gradients (``compute``, ``loss_chunk_tokens``,
    ``cp``: as in :func:`forward_backward`)."""
    inputs, labels, shard = model_inputs(input_ids, labels, position_ids, cp)
    with loss_parallel(), running(shard), compute or nullcontext():
        loss_sum = _losses(model, inputs, labels, cp is not None, loss_chunk_tokens, None)[0]
    return _whole(loss_sum).item()
