"""What each rank of ``recipes/distill.py`` runs: ``finetune.py``'s story with distillation's step.

Set up is fine-tuning's (mesh, data, the student built, converted, parallelised, optimizer,
schedule, resume) plus the frozen teacher, built, split by its own TP plan and loaded on the
student's meshes (``components/models/frozen.py``). Each micro-batch runs the teacher's forward
under ``no_grad``, then the student's, and the loss over both vocabulary-parallel heads
(``components/training/distillation.py``); then fine-tuning's gradient reductions, clip and
update. Its metrics are the loss, the cross entropy and the KL, each over the step's labelled
tokens. Finish (drift report, export of the student, loss curve) is fine-tuning's.
"""

import functools

import torch

from components.models.frozen import build_frozen_model
from components.training.distillation import (
    DISTILL_METRICS,
    DistillStep,
    check_chunked_heads,
    distill_forward_backward,
)
from recipes import finetune_rank
from recipes.plan import DistillPlan, RecipeSteps, Run


def distill_options(run: Run, plan: DistillPlan) -> DistillStep:
    """The loss's settings and the frozen teacher, built on ``run``'s meshes."""
    teacher = build_frozen_model(plan.teacher, plan.dims, run.meshes, run.device)
    check_chunked_heads(run.state.model, teacher)
    distill, train = plan.settings.distill, plan.train
    chunk = train.loss_chunk_tokens or train.seq_len * train.micro_batch_size  # 0: one chunk
    return DistillStep(
        teacher=teacher,
        alpha=distill.alpha,
        temperature=distill.temperature,
        compute=run.compute,
        chunk_tokens=chunk,
        aux_loss_weight=run.aux_loss_weight,
        cp=run.cp,
    )


def distill_step(run: Run, plan: DistillPlan, step: int, distill: DistillStep) -> torch.Tensor:
    """The step function: every micro-batch of step ``step``, forward (teacher, then student) and
    backward; the sums of :data:`DISTILL_METRICS` over this rank's tokens (float64)."""
    labelled = run.data.labels_in_step(step)
    sums = torch.zeros(len(DISTILL_METRICS), dtype=torch.float64, device=run.device)
    for batch in finetune_rank.step_micro_batches(run, step):
        sums += distill_forward_backward(run.state.model, batch, labelled, distill)  # no read
    return sums


def distill_record(run: Run, plan: DistillPlan, step: int, sums: list[float]) -> dict:
    """The step's metrics: each sum over the step's labelled tokens (their mean)."""
    labelled = run.data.labels_in_step(step)
    return {name: total / labelled for name, total in zip(DISTILL_METRICS, sums, strict=True)}


def distill_steps(run: Run, plan: DistillPlan) -> RecipeSteps:
    """Distillation's step function and metrics for ``run``, its teacher built on its meshes, and
    fine-tuning's validation (the student's cross entropy on the held-out rows)."""
    step = functools.partial(distill_step, distill=distill_options(run, plan))
    return RecipeSteps(step=step, record=distill_record, validate=finetune_rank.token_validation)


def rank_main(plan: DistillPlan) -> str | None:
    """Fine-tuning's rank story (``finetune_rank.rank_main``) with distillation's step."""
    return finetune_rank.rank_main(plan, steps=distill_steps)
