"""Knowledge distillation's loss over vocabulary-parallel logits, in token chunks: the student's
cross entropy and KL(teacher ‖ student) at temperature T, from both models' last hidden states
and heads, a chunk of labelled tokens at a time, so at most one chunk's logits of each model
exist, and under TP only this rank's vocabulary shard of them.

Per chunk, each model's logits are its hidden states times its head's weight rows (the student's
with its adapter's update, as :mod:`components.distributed.chunked_loss` computes them); the
maxima are all-reduced (one collective), then the sums of exponentials at 1 and at T and the
target logit (another); each token's KL, a sum over the vocabulary, is summed over the TP group
once after the last chunk. Backward recomputes both models' logits chunk by chunk: the student's
gradient is ``g_ce · (softmax(z) − one-hot) + g_kl · (softmax(z/T) − softmax(t/T)) / T``. The
teacher takes no gradient.

Design notes: docs/design-notes.md
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.distributed.chunked_loss import (
    LOSS_CHUNK_TOKENS,
    ChunkedHead,
    ChunkLogits,
    ChunkSettings,
    HeadAdapter,
    HeadGradients,
    chunked_head,
    next_token_targets,
    target_logit,
)


@dataclass(frozen=True, kw_only=True)
class DistillationSettings(ChunkSettings):
    """The student's :class:`ChunkSettings`, the teacher's logits' dtype and the temperature."""

    teacher_dtype: torch.dtype
    temperature: float


class _ChunkedDistillation(torch.autograd.Function):
    """(cross-entropy sum, KL sum) over the picked tokens of the student head (``hidden``,
    ``weight``, ``adapter_in``, ``B`` as ``_ChunkedHeadLogProbs`` takes them)
    against the teacher's (``teacher_hidden`` [tokens, teacher hidden], ``teacher_weight`` the
    same vocabulary rows as ``weight``)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, adapter_in, B, teacher_hidden, teacher_weight, targets, picked,
        settings: DistillationSettings,
    ):  # fmt: skip
        (group, start), chunk, temperature = settings.shard, settings.chunk, settings.temperature
        hidden_picked = hidden.index_select(0, picked)
        teacher_picked = teacher_hidden.index_select(0, picked)
        local = targets.index_select(0, picked) - start
        adapter_picked = None if adapter_in is None else adapter_in.index_select(0, picked)
        lses = torch.empty(3, picked.numel(), dtype=torch.float32, device=hidden.device)
        kl = torch.empty(picked.numel(), dtype=torch.float32, device=hidden.device)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            student = ChunkLogits(
                weight, adapter_picked, B, settings.scaling, settings.compute_dtype
            )
            teacher = ChunkLogits(teacher_weight, None, None, None, settings.teacher_dtype)
            for begin in range(0, picked.numel(), chunk):
                rows = slice(begin, begin + chunk)
                s = student.logits(hidden_picked[rows], rows).float()
                t = teacher.logits(teacher_picked[rows], rows).float()
                target = target_logit(s, local[rows])
                top = torch.stack([s.amax(-1), t.amax(-1)])
                if group is not None:
                    dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
                shifted, teacher_shifted = s - top[0, :, None], t - top[1, :, None]
                sums = torch.stack(
                    [
                        shifted.exp().sum(-1),
                        shifted.div(temperature).exp_().sum(-1),
                        teacher_shifted.div(temperature).exp_().sum(-1),
                        target,
                    ]
                )
                if group is not None:
                    dist.all_reduce(sums, group=group)
                lses[:, rows] = _log_sum_exps(top, sums[:3], temperature)
                ce += (lses[0, rows] - sums[3]).sum()
                log_student = s.div_(temperature).sub_(lses[1, rows, None])
                log_teacher = t.div_(temperature).sub_(lses[2, rows, None])
                kl[rows] = log_teacher.exp().mul_(log_teacher - log_student).sum(-1)
        if group is not None:
            dist.all_reduce(kl, group=group)
        ctx.save_for_backward(
            hidden_picked, weight, adapter_picked, B, teacher_picked, teacher_weight, local,
            picked, lses,
        )  # fmt: skip
        ctx.settings, ctx.rows = settings, hidden.shape[0]
        return ce, kl.sum()

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        (hidden_picked, weight, adapter_picked, B, teacher_picked, teacher_weight, local, picked,
         lses) = ctx.saved_tensors  # fmt: skip
        settings = ctx.settings
        temperature, compute_dtype = settings.temperature, settings.compute_dtype
        grads = HeadGradients(hidden_picked, weight, adapter_picked, B, ctx.needs_input_grad[1])
        with torch.autocast(hidden_picked.device.type, enabled=False):
            student = ChunkLogits(weight, adapter_picked, B, settings.scaling, compute_dtype)
            teacher = ChunkLogits(teacher_weight, None, None, None, settings.teacher_dtype)
            for begin in range(0, picked.numel(), settings.chunk):
                rows = slice(begin, begin + settings.chunk)
                h = hidden_picked[rows].to(compute_dtype)
                s = student.logits(h, rows).float()
                t = teacher.logits(teacher_picked[rows], rows).float()
                probs = (s - lses[0, rows, None]).exp_()
                ids = local[rows]
                inside = ((ids >= 0) & (ids < probs.shape[1])).nonzero().squeeze(1)
                probs[inside, ids[inside]] -= 1  # d CE / d z = softmax(z) - one-hot(target)
                soft = s.div_(temperature).sub_(lses[1, rows, None]).exp_()
                soft -= t.div_(temperature).sub_(lses[2, rows, None]).exp_()
                grad_logits = probs.mul_(grad_ce).add_(soft, alpha=1.0 / temperature * grad_kl)
                grads.add(student, grad_logits.to(compute_dtype), h, rows)
        return (*grads.results(picked, ctx.rows), *[None] * 5)


def _log_sum_exps(top: torch.Tensor, sums: torch.Tensor, temperature: float) -> torch.Tensor:
    """[3, rows]: the student's log-sum-exp at 1 and at ``temperature``, the teacher's at
    ``temperature``, from the maxima ``top`` (student, teacher) and the shifted sums."""
    scaled = torch.stack([top[0], top[0] / temperature, top[1] / temperature])
    return scaled + sums.log()


def chunked_distillation_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    shifted: bool = False,
    adapter: HeadAdapter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross entropy, KL(teacher ‖ student) at ``temperature``), each summed over the positions
    with a next-token label (``-100`` ignored), ``chunk_tokens`` at a time: the KL of
    ``softmax(teacher_logits / T)`` and ``softmax(student_logits / T)`` over the whole vocabulary,
    the cross entropy at temperature 1, what ``F.cross_entropy`` and ``F.kl_div`` (``sum``) compute
    on the whole logits.

    The student's ``hidden``, ``weight``, ``adapter``, ``labels`` and ``shifted`` as
    :func:`~components.distributed.chunked_loss.chunked_cross_entropy_sum` takes them; the
    teacher's ``teacher_hidden`` [batch, seq, teacher hidden] (its forward's, without a gradient)
    and ``teacher_weight`` [vocab, teacher hidden], the same vocabulary split over the same TP
    mesh as ``weight``. Returns two plain scalars, the same on every TP rank; only the student's
    inputs take gradients.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    _check_same_vocabulary(weight, teacher_weight)
    student = chunked_head(hidden, weight, adapter)
    teacher = chunked_head(teacher_hidden.detach(), teacher_weight.detach())
    _check_same_shard(student, teacher)
    targets = next_token_targets(labels, shifted)
    picked = (targets != -100).nonzero().squeeze(1)
    settings = DistillationSettings(
        **vars(student.settings(chunk_tokens)),
        teacher_dtype=teacher.compute_dtype,
        temperature=temperature,
    )
    return _ChunkedDistillation.apply(
        *student.inputs, teacher.hidden, teacher.weight, targets, picked, settings
    )


def distillation_loss(
    ce_sum: torch.Tensor, kl_sum: torch.Tensor, tokens: int, alpha: float, temperature: float
) -> torch.Tensor:
    """``alpha · CE + (1 − alpha) · T² · KL``, both averaged over ``tokens`` labelled tokens (the
    global count the sums are divided by: the step's, over micro-batches and data-parallel
    ranks)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    return (alpha * ce_sum + (1.0 - alpha) * temperature**2 * kl_sum) / tokens


def _check_same_vocabulary(weight: torch.Tensor, teacher_weight: torch.Tensor) -> None:
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"the teacher's vocabulary ({teacher_weight.shape[0]}) must equal the student's "
            f"({weight.shape[0]})"
        )
    placements = [getattr(w, "placements", None) for w in (weight, teacher_weight)]
    meshes = [w.device_mesh if isinstance(w, DTensor) else None for w in (weight, teacher_weight)]
    if placements[0] != placements[1] or meshes[0] != meshes[1]:
        raise ValueError(
            "the teacher's head must be split over the vocabulary as the student's is: "
            f"student {placements[0]}, teacher {placements[1]}"
        )


def _check_same_shard(student: ChunkedHead, teacher: ChunkedHead) -> None:
    """Both heads hold the same vocabulary rows on this rank."""
    if student.shard[1] != teacher.shard[1] or student.weight.shape[0] != teacher.weight.shape[0]:
        raise ValueError("the teacher's head holds other vocabulary rows than the student's")
