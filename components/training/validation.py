"""The validation loss: every validation row once, the token-mean loss over all dp (× cp) ranks;
DPO's validation metrics: every held-out pair once, their means over all dp ranks."""

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn

from components.data import StepBatches
from components.distributed.chunked_loss import LOSS_CHUNK_TOKENS
from components.distributed.context_parallel import ContextParallel
from components.training.preference import DPO_METRICS, DpoStep, dpo_evaluate
from components.training.step import evaluate_loss_sum


def validation_loss(
    model: nn.Module,
    batches: StepBatches,
    device: torch.device,
    dp_group: dist.ProcessGroup,
    compute: AbstractContextManager | None = None,
    loss_chunk_tokens: int | None = LOSS_CHUNK_TOKENS,
    cp: ContextParallel | None = None,
) -> float:
    """Mean token loss over every validation row (each dp rank takes its share), the model left in
    train mode; ``compute`` is the precision's context for the forward (a fresh one per batch is not
    needed: it is re-entrant). ``loss_chunk_tokens``, ``cp``: as in ``forward_backward``; with cp,
    ``dp_group`` is the dp × cp group, each cp rank sums its tokens' loss and one counts the
    tokens."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # dp groups are NCCL-only on CUDA
    model.eval()
    for batch in batches.all_batches():
        batch = batch.to(device)
        tensors = (batch.input_ids, batch.labels, batch.position_ids)
        totals[0] += evaluate_loss_sum(model, *tensors, compute, loss_chunk_tokens, cp)
        totals[1] += batch.labelled_tokens() if cp is None or cp.rank == 0 else 0
    model.train()
    return _mean_over(totals, dp_group)


def _mean_over(totals: torch.Tensor, dp_group: dist.ProcessGroup) -> float:
    """The loss sum over the token count (``totals``), each summed over ``dp_group`` first."""
    dist.all_reduce(totals, group=dp_group)
    return (totals[0] / totals[1]).item()


def validation_losses(run, loss_chunk_tokens: int) -> dict[str, float]:
    """``val_loss`` on a recipe run's whole validation split, and ``val_loss/<name>`` on each
    source's of a mixture (``run.val_sources``)."""
    losses = {"val_loss": run_validation(run, run.val_data, loss_chunk_tokens)}
    for name, batches in run.val_sources.items():
        losses[f"val_loss/{name}"] = run_validation(run, batches, loss_chunk_tokens)
    return losses


def run_validation(run, batches: StepBatches, loss_chunk_tokens: int | None) -> float:
    """The mean loss on the validation ``batches`` of a recipe run (``run``: its model, device,
    mesh, compute context and cp): ``run.val_data``, or a mixture's source's; the same on every
    rank."""
    dp_group = run.meshes.loss.get_group()  # dp × cp
    model = run.state.model
    if run.pipeline is not None:
        return pipeline_validation_loss(run.pipeline, model, batches, run.device, dp_group)
    where = (run.device, dp_group, run.compute(), loss_chunk_tokens, run.cp)
    return validation_loss(model, batches, *where)


def pipeline_validation_loss(
    pipeline, model: nn.Module, batches: StepBatches, device: torch.device, dp_group
) -> float:
    """:func:`validation_loss` through a pipeline's stages (``pipeline``: this rank's
    ``Pipeline``, ``model`` its kept stages): every validation row once, forward only, the same
    mean on every rank."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    micro_batches = [batch.to(device) for batch in batches.all_batches()]
    totals[0] += pipeline.evaluate(micro_batches, batches.micro_batch_size, batches.pad_id)
    model.train()
    totals[1] += sum(batch.labelled_tokens() for batch in micro_batches)
    return _mean_over(totals, dp_group)


def preference_validation(run, batches: StepBatches, step: DpoStep) -> dict[str, float]:
    """DPO's metrics (:data:`DPO_METRICS`, each named with ``val_`` before it: ``val_loss`` is the
    DPO loss) on every held-out pair of ``batches`` once, each dp rank its share, the policy
    (``run.state.model``) in eval mode: each the mean over the pairs, the same on every rank."""
    sums = torch.zeros(len(DPO_METRICS) + 1, dtype=torch.float64, device=run.device)
    model = run.state.model
    model.eval()
    for batch in batches.all_batches():
        sums += dpo_evaluate(model, batch.to(run.device), step)
    model.train()
    dist.all_reduce(sums, group=run.meshes.loss.get_group())
    *totals, pairs = sums.tolist()
    return {f"val_{name}": total / pairs for name, total in zip(DPO_METRICS, totals, strict=True)}
