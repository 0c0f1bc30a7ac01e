"""Direct Preference Optimization's loss on sequence log-probabilities: a policy against a frozen
reference, over pairs of a chosen and a rejected answer to one prompt.

The inputs are each answer's summed log-probability of its labelled tokens, the policy's and the
reference's (:func:`~components.distributed.chunked_loss.chunked_token_log_probs` summed over a
row); the loss and the metrics follow TRL 1.16's ``DPOTrainer._compute_loss``. With
``Δ = (π_c − ref_c) − (π_r − ref_r)``: ``sigmoid`` is ``−log σ(β·Δ)`` (with ``label_smoothing`` ε,
conservative DPO: ``−(1 − ε)·log σ(β·Δ) − ε·log σ(−β·Δ)``); ``ipo`` is
``(Δ_c/n_c − Δ_r/n_r − 1/(2β))²``, each log-ratio averaged over its ``n`` labelled tokens as TRL
does. A batch's loss is the mean over its pairs; the rewards are ``β·(π − ref)`` of each answer.
:func:`dpo_forward_backward` is DPO's micro-batch: both models' answer log-probabilities from the
chunked, vocabulary-parallel head, the loss, backward; :func:`dpo_evaluate`, held-out pairs'.

Design notes: docs/design-notes.md
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from components.data.collate import IGNORE_INDEX
from components.data.loader import Batch
from components.distributed.chunked_loss import (
    PLAIN_HEAD_FAMILIES,
    chunked_head,
    chunked_token_log_probs,
    chunks_head,
    head_weights,
    lm_head_skipped,
)
from components.models.lora import adapters_off
from components.moe.load_balance import load_balancing_loss
from components.training.options import DPO_LOSS_TYPES


@dataclass(frozen=True, kw_only=True)
class DpoOptions:
    """``beta`` > 0; ``loss_type`` one of :data:`DPO_LOSS_TYPES`; ``label_smoothing`` ε in
    [0, 0.5), ``sigmoid`` only (the assumed probability that a pair's preference is flipped)."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing applies to loss_type sigmoid only, not ipo")


@dataclass(frozen=True, kw_only=True)
class PairLogProbs:
    """One model's summed answer log-probabilities, [pairs] each: of the ``chosen`` and the
    ``rejected`` answers."""

    chosen: torch.Tensor
    rejected: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class DpoLosses:
    """Per pair: the ``losses`` (differentiable), the policy's and reference's log-probabilities and
    the rewards ``β·(π − ref)`` (detached)."""

    losses: torch.Tensor
    policy: PairLogProbs
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's metrics, per pair (their means over a step's pairs are what TRL logs):
        ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``
        (1 where the chosen answer's reward exceeds the rejected's), ``logps/chosen``,
        ``logps/rejected``, and the ``loss``."""
        return {
            "loss": self.losses.detach(),
            "rewards/chosen": self.chosen_rewards,
            "rewards/rejected": self.rejected_rewards,
            "rewards/margins": self.chosen_rewards - self.rejected_rewards,
            "rewards/accuracies": (self.chosen_rewards > self.rejected_rewards).float(),
            "logps/chosen": self.policy.chosen.detach(),
            "logps/rejected": self.policy.rejected.detach(),
        }


def dpo_losses(
    policy: PairLogProbs,
    reference: PairLogProbs,
    options: DpoOptions,
    answer_tokens: PairLogProbs | None = None,
) -> DpoLosses:
    """Each pair's DPO loss (module docstring) of the ``policy``'s log-probabilities against the
    ``reference``'s (detached here: the reference is frozen). ``answer_tokens``: each answer's
    labelled-token count [pairs], which ``ipo`` needs."""
    chosen_ratio = policy.chosen - reference.chosen.detach()
    rejected_ratio = policy.rejected - reference.rejected.detach()
    if options.loss_type == "sigmoid":
        delta = options.beta * (chosen_ratio - rejected_ratio)
        smoothing = options.label_smoothing
        losses = -F.logsigmoid(delta) * (1 - smoothing) - F.logsigmoid(-delta) * smoothing
    else:
        if answer_tokens is None:
            raise ValueError("loss_type ipo needs each answer's token count")
        delta = chosen_ratio / answer_tokens.chosen.clamp(min=1) - rejected_ratio / (
            answer_tokens.rejected.clamp(min=1)
        )
        losses = (delta - 1 / (2 * options.beta)) ** 2
    return DpoLosses(
        losses=losses,
        policy=policy,
        chosen_rewards=options.beta * chosen_ratio.detach(),
        rejected_rewards=options.beta * rejected_ratio.detach(),
    )


# A step's DPO sums, in this order: what dpo_forward_backward returns, the recipe's metrics' names.
DPO_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True, kw_only=True)
class Answers:
    """One forward's answers: each row's summed log-probability of its labelled tokens [rows]
    (fp32), and an MoE model's load-balancing loss over their real tokens (None: it computes
    none)."""

    log_probs: torch.Tensor
    aux_loss: torch.Tensor | None


def answers(model: nn.Module, batch: Batch, chunk_tokens: int) -> Answers:
    """The model's forward up to the hidden states, then the chunked head (``chunk_tokens``
    labelled tokens at a time, the vocabulary split over TP as the head's weight: no rank holds
    the whole vocabulary's logits): :class:`Answers`.

    Raises:
        ValueError: For a model whose head the chunked loss does not compute (``chunks_head``).
    """
    if not chunks_head(model):
        raise ValueError(
            f"DPO needs a plain linear lm_head of a {', '.join(PLAIN_HEAD_FAMILIES)} model; "
            f"this {type(model).__name__}'s head is not one"
        )
    with lm_head_skipped(model) as head:
        outputs = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    weights = head_weights(head)  # after the forward: FSDP's root holds the head unsharded
    hidden = chunked_head(outputs.logits, weights.weight, weights.adapter)
    log_probs = chunked_token_log_probs(hidden, batch.labels, chunk_tokens).sum(-1)
    aux_loss = getattr(outputs, "aux_loss", None)  # an MoE model's, with output_router_logits
    if aux_loss is not None:  # over the real tokens (its own counts the padding)
        aux_loss = load_balancing_loss(model, outputs, batch.real_mask())
    return Answers(log_probs=log_probs, aux_loss=aux_loss)


def answer_log_probs(model: nn.Module, batch: Batch, chunk_tokens: int) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens [rows], fp32 (:func:`answers`)."""
    return answers(model, batch, chunk_tokens).log_probs


def _pairs(values: torch.Tensor) -> PairLogProbs:
    chosen, rejected = values.chunk(2)  # the batch is [chosen rows, rejected rows]
    return PairLogProbs(chosen=chosen, rejected=rejected)


@dataclass(frozen=True, kw_only=True)
class DpoStep:
    """How a DPO micro-batch runs: the loss's ``options``, the precision's ``compute`` context,
    ``chunk_tokens`` of the head at a time, the frozen ``reference`` (None: the policy with its
    adapters switched off, ``peft=lora``), and the weight of an MoE policy's load-balancing loss
    in the backward (``components.moe.router_aux_loss_weight``; 0: none)."""

    options: DpoOptions
    compute: Callable[[], AbstractContextManager]
    chunk_tokens: int
    reference: nn.Module | None
    aux_loss_weight: float = 0.0


def reference_log_probs(policy: nn.Module, batch: Batch, step: DpoStep) -> PairLogProbs:
    """The reference's answer log-probabilities, without gradients: the frozen model's, or with
    no reference model the policy's own with its adapters off (its base, no second copy)."""
    with torch.no_grad(), step.compute():
        if step.reference is not None:
            return _pairs(answer_log_probs(step.reference, batch, step.chunk_tokens))
        with adapters_off(policy):
            return _pairs(answer_log_probs(policy, batch, step.chunk_tokens))


def dpo_forward_backward(
    policy: nn.Module, batch: Batch, pairs_in_step: int, step: DpoStep
) -> torch.Tensor:
    """One micro-batch of pairs (``batch``: its chosen rows, then its rejected rows): the
    reference's and the policy's answer log-probabilities, the DPO loss of each pair, backward of
    their sum over ``pairs_in_step`` (the global batch's pairs, every micro-batch and dp rank:
    the summed gradients are the mean loss's), with an MoE policy's load-balancing loss times
    ``step.aux_loss_weight``. Returns the micro-batch's sums of
    :data:`DPO_METRICS` [7] float64, on the device (not read)."""
    reference = reference_log_probs(policy, batch, step)
    with step.compute():
        policy_answers = answers(policy, batch, step.chunk_tokens)
        policy_logps = _pairs(policy_answers.log_probs)
        answer_tokens = _pairs((batch.labels[:, 1:] != IGNORE_INDEX).sum(-1))
        losses = dpo_losses(policy_logps, reference, step.options, answer_tokens)
    objectives = [losses.losses.sum() / pairs_in_step]
    if step.aux_loss_weight and policy_answers.aux_loss is not None:  # TRL's aux_loss_coef term
        objectives.append(policy_answers.aux_loss * step.aux_loss_weight)
    torch.autograd.backward(objectives)
    metrics = losses.metrics()
    return torch.stack([metrics[name].sum().double() for name in DPO_METRICS])


def dpo_evaluate(policy: nn.Module, batch: Batch, step: DpoStep) -> torch.Tensor:
    """A held-out micro-batch of pairs, forward only: the sums of :data:`DPO_METRICS` over its
    pairs, then the number of pairs [8] float64, on the device (not read). A pair of no answer
    tokens (a dp share's padding, ``components/data/loader.py`` ``PAD_ROW``) counts nothing."""
    with torch.no_grad():
        reference = reference_log_probs(policy, batch, step)
        with step.compute():
            policy_logps = _pairs(answer_log_probs(policy, batch, step.chunk_tokens))
        answer_tokens = _pairs((batch.labels[:, 1:] != IGNORE_INDEX).sum(-1))
        metrics = dpo_losses(policy_logps, reference, step.options, answer_tokens).metrics()
    real = answer_tokens.chosen + answer_tokens.rejected > 0
    sums = [torch.where(real, metrics[name], 0).sum().double() for name in DPO_METRICS]
    return torch.stack([*sums, real.sum().double()])
