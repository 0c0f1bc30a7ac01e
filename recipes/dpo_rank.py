"""What each rank of ``recipes/dpo.py`` runs: ``finetune.py``'s story with DPO's step.

Set up is fine-tuning's (mesh, preference pairs, the policy built, converted, parallelised,
optimizer, schedule, resume) plus the frozen reference: the policy's starting weights built and
sharded by the same plan (``components/models/frozen.py``), or with ``peft=lora`` none, the
policy with its adapters off. Each step runs both models on every micro-batch of pairs
(``components/training/preference.py``), then fine-tuning's gradient reductions, clip and update;
its metrics are DPO's, summed over the step's pairs and read with the step's other values. Where
the cadence validates, the same metrics on every held-out pair (``val_loss``, ``val_rewards/...``).
Finish (drift report, export of the policy, loss curve) is fine-tuning's.
"""

import functools

import torch

from components.models.frozen import build_frozen_model
from components.training.preference import (
    DPO_METRICS,
    DpoOptions,
    DpoStep,
    dpo_forward_backward,
)
from components.training.validation import preference_validation
from recipes import finetune_rank
from recipes.plan import DpoPlan, RecipeSteps, Run


def dpo_step_options(run: Run, plan: DpoPlan) -> DpoStep:
    """The loss's options, the reference (``plan.reference``) built frozen on the policy's
    meshes (None with ``peft=lora``: the policy with its adapters off), and the weight of an MoE
    policy's load-balancing loss."""
    dpo, train = plan.settings.dpo, plan.train
    options = DpoOptions(**dpo.model_dump(exclude={"reference_path"}))
    reference = None
    if plan.reference is not None:
        reference = build_frozen_model(plan.reference, plan.dims, run.meshes, run.device)
    chunk = train.loss_chunk_tokens or train.seq_len * train.micro_batch_size * 2  # 0: one chunk
    return DpoStep(
        options=options,
        compute=run.compute,
        chunk_tokens=chunk,
        reference=reference,
        aux_loss_weight=run.aux_loss_weight,  # an MoE policy's load-balancing loss, as TRL adds it
    )


def dpo_step(run: Run, plan: DpoPlan, step: int, dpo: DpoStep) -> torch.Tensor:
    """The step function: every micro-batch of step ``step``'s pairs, forward (reference, then
    policy) and backward; the sums of :data:`DPO_METRICS` over this rank's pairs (float64)."""
    sums = torch.zeros(len(DPO_METRICS), dtype=torch.float64, device=run.device)
    for batch in finetune_rank.step_micro_batches(run, step):
        sums += dpo_forward_backward(run.state.model, batch, plan.train.global_batch_size, dpo)
    return sums


def dpo_metrics(run: Run, plan: DpoPlan, step: int, sums: list[float]) -> dict:
    """The step's DPO metrics: each sum over the global batch's pairs, their mean."""
    pairs = plan.train.global_batch_size
    return {name: total / pairs for name, total in zip(DPO_METRICS, sums, strict=True)}


def dpo_validation(run: Run, plan: DpoPlan, dpo: DpoStep) -> dict:
    """DPO's metrics on every held-out pair once, ``val_`` before each name (``val_loss``: the
    DPO loss), each the mean over the pairs."""
    return preference_validation(run, run.val_data, dpo)


def dpo_steps(run: Run, plan: DpoPlan) -> RecipeSteps:
    """DPO's step function, metrics and validation for ``run``, its reference built on ``run``'s
    meshes."""
    dpo = dpo_step_options(run, plan)
    return RecipeSteps(
        step=functools.partial(dpo_step, dpo=dpo),
        record=dpo_metrics,
        validate=functools.partial(dpo_validation, dpo=dpo),
    )


def rank_main(plan: DpoPlan) -> str | None:
    """Fine-tuning's rank story (``finetune_rank.rank_main``) with DPO's steps."""
    return finetune_rank.rank_main(plan, steps=dpo_steps)
