"""Knowledge distillation's micro-batch: a frozen teacher's forward (no gradients), the student's,
and ``alpha · CE + (1 − alpha) · T² · KL(teacher ‖ student)`` over the same labelled tokens.

Both models run their own forward up to the decoder's last hidden states; the loss multiplies
them by each head's weight a chunk of labelled tokens at a time, over the vocabulary split by
tensor parallelism (:func:`~components.distributed.chunked_distillation.chunked_distillation_sums`),
so no rank ever holds either model's logits over the whole vocabulary. Under context parallelism
each cp rank runs its share of the tokens through both models, as the fine-tuning step does.

Docs: docs/distillation.md
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from components.data.loader import Batch
from components.distributed.chunked_distillation import (
    chunked_distillation_sums,
    distillation_loss,
)
from components.distributed.chunked_loss import PLAIN_HEAD_FAMILIES, chunks_head
from components.distributed.context_parallel import ContextParallel, running
from components.moe.load_balance import load_balancing_loss
from components.training.step import last_hidden_states, model_inputs

# A step's distillation sums, in this order: what distill_forward_backward returns, the recipe's
# metrics' names (each sum divided by the step's labelled tokens).
DISTILL_METRICS = ("loss", "ce_loss", "kd_loss")


@dataclass(frozen=True, kw_only=True)
class DistillStep:
    """How a distillation micro-batch runs: the frozen ``teacher`` (on the student's meshes),
    ``alpha`` in [0, 1] and ``temperature`` > 0, the precision's ``compute`` context,
    ``chunk_tokens`` labelled tokens of the heads at a time, the student's MoE
    ``aux_loss_weight`` and this rank's context-parallel group ``cp`` (None at cp=1)."""

    teacher: nn.Module
    alpha: float
    temperature: float
    compute: Callable[[], AbstractContextManager]
    chunk_tokens: int
    aux_loss_weight: float = 0.0
    cp: ContextParallel | None = None


def check_chunked_heads(*models: nn.Module) -> None:
    """Each model's head is one the chunked loss computes (a plain linear ``lm_head`` of a family
    whose forward ends in it), else ValueError."""
    for model in models:
        if not chunks_head(model):
            raise ValueError(
                f"distillation needs a plain linear lm_head of a {', '.join(PLAIN_HEAD_FAMILIES)} "
                f"model; this {type(model).__name__}'s head is not one"
            )


def distill_forward_backward(
    student: nn.Module, batch: Batch, global_tokens: int, step: DistillStep
) -> torch.Tensor:
    """One micro-batch: the teacher's forward under ``no_grad``, the student's, the loss divided
    by ``global_tokens`` (the step's labelled tokens over every micro-batch and dp rank, so the
    summed gradients are the global mean loss's) and its backward. Returns the micro-batch's sums
    of :data:`DISTILL_METRICS` [3] float64 on the device (not read; under cp this rank's share)."""
    check_chunked_heads(student, step.teacher)
    inputs, labels, shard = model_inputs(batch.input_ids, batch.labels, batch.position_ids, step.cp)
    alpha, temperature, shifted = step.alpha, step.temperature, step.cp is not None
    with loss_parallel(), running(shard):  # the backward of a cp shard runs inside it too
        with torch.no_grad(), step.compute():
            taught, teacher_head = last_hidden_states(step.teacher, inputs)
        with step.compute():
            outputs, head = last_hidden_states(student, inputs)
            ce, kl = chunked_distillation_sums(
                outputs.logits, head.weight, taught.logits, teacher_head.weight, labels,
                temperature, step.chunk_tokens, shifted, head.adapter,
            )  # fmt: skip
            loss = distillation_loss(ce, kl, global_tokens, alpha, temperature)
        objectives = [loss]
        real = batch.real_mask() if step.aux_loss_weight and not shard else None  # cp: dense
        aux_loss = load_balancing_loss(student, outputs, real)
        if step.aux_loss_weight and aux_loss is not None:
            objectives.append(aux_loss * step.aux_loss_weight)
        torch.autograd.backward(objectives)
    sums = torch.stack([distillation_loss(ce, kl, 1, alpha, temperature), ce, kl])
    return sums.detach().to(torch.float64)
