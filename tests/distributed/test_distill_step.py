"""Distillation's micro-batch (``distill_forward_backward``, the step ``recipes/distill.py`` runs)
at tp=2 (gloo) on tiny Llamas split by their own TP plans, with and without sequence parallelism:
its sums equal the same micro-batch's at tp=1 within 1e-5, and a spy on every op's output sees
this rank's half of the vocabulary's logits and never a tensor of the whole vocabulary's width,
forward or backward, of either model (a DTensor counted by its local shard: what the rank
holds)."""

from contextlib import nullcontext

import pytest
import torch

from components.data.loader import Batch
from components.distributed.tp_plan import apply_tp_plan
from components.models import build_causal_lm
from components.models.families import plan_for
from components.training.distillation import DistillStep, distill_forward_backward
from recipes.tiny_models import tiny_config
from tests.distributed.test_post_training_losses import Widths
from tests.harness import mesh
from tests.unit.training.test_chunked_loss import batch, relative

VOCAB = 300  # no other size of either model: a tensor this wide is logits over the whole of it


def models(tp_mesh, sequence_parallel: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The student and a frozen teacher twice its width, split by their plans on ``tp_mesh``
    (None: whole)."""
    student_config = tiny_config("llama", vocab_size=VOCAB)
    teacher_config = tiny_config("llama", vocab_size=VOCAB, hidden_size=128, head_dim=16)
    student = build_causal_lm(student_config, seed=0)
    teacher = build_causal_lm(teacher_config, seed=1).requires_grad_(False).eval()
    for model, config in ((student, student_config), (teacher, teacher_config)):
        if tp_mesh is not None:
            plan = plan_for(config, sequence_parallel)
            apply_tp_plan(model, tp_mesh, plan, config, sequence_parallel)
    return student, teacher


def sums(student, teacher, data: Batch) -> torch.Tensor:
    options = dict(alpha=0.5, temperature=2.0, compute=nullcontext, chunk_tokens=8)
    tokens = int((data.labels[:, 1:] != -100).sum())
    return distill_forward_backward(student, data, tokens, DistillStep(teacher=teacher, **options))


def check_step(rank, world_size, sequence_parallel):
    tokens, labels = batch(VOCAB, seq=48)
    positions = torch.arange(48).expand(2, 48)
    whole = torch.full((2,), 48)  # every position an example token
    data = Batch(input_ids=tokens, labels=labels, position_ids=positions, real_tokens=whole)
    want = sums(*models(None, sequence_parallel), data)
    split = models(mesh((world_size,), ("tp",)), sequence_parallel)
    with Widths() as spy:
        got = sums(*split, data)
    return relative(got, want), spy.seen


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_distillation_step_at_tp2_holds_no_whole_vocabulary(ranks2, sequence_parallel):
    for error, widths in ranks2.run(check_step, sequence_parallel):
        assert error <= 1e-5, error
        assert VOCAB // 2 in widths and VOCAB not in widths  # each rank its half's logits only
