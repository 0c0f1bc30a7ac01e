"""Distillation's micro-batch (``distill_forward_backward``, the step ``recipes/distill.py`` runs)
at tp=1 equals a plain PyTorch reference written here: the teacher's forward under ``no_grad``,
``F.kl_div`` on the whole vocabulary's log-softmax at temperature T, plus ``F.cross_entropy``;
five optimizer steps within 1e-5 (loss, CE and KL), at alpha 0, 0.5 and 1, with SGD (and AdamW
at 0.5). The teacher (a bigger model, the same vocabulary) takes no gradient and stays as it
was."""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from components.data.loader import Batch
from components.models import build_causal_lm
from components.training.distillation import DistillStep, distill_forward_backward
from recipes.tiny_models import tiny_config

STEPS, TEMPERATURE, VOCAB, CHUNK = 5, 2.0, 300, 7
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3),
}


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The student (the tiny Llama) and a frozen teacher twice its width and depth."""
    student = build_causal_lm(tiny_config("llama", vocab_size=VOCAB), seed=0)
    bigger = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=16)
    teacher = build_causal_lm(tiny_config("llama", vocab_size=VOCAB, **bigger), seed=1)
    return student, teacher.requires_grad_(False).eval()


def batch() -> Batch:
    """Four rows of 24 tokens, each row's first tokens unlabelled (a prompt) and the last row's
    tail padding, as the recipe's loader makes them."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (4, 24), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100
    labels[3, 18:] = -100
    positions = torch.arange(24).expand(4, 24)
    whole = torch.full((4,), 24)  # every position an example token
    return Batch(input_ids=input_ids, labels=labels, position_ids=positions, real_tokens=whole)


def reference_sums(student, teacher, data: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL(teacher ‖ student) at T) summed over the labelled next tokens, on whole logits."""
    inputs = dict(input_ids=data.input_ids, position_ids=data.position_ids, use_cache=False)
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1]
    logits = student(**inputs).logits[:, :-1]
    targets = data.labels[:, 1:]
    kept = targets != -100
    ce = F.cross_entropy(logits[kept], targets[kept], reduction="sum")
    log_student = F.log_softmax(logits[kept] / TEMPERATURE, dim=-1)
    log_teacher = F.log_softmax(teacher_logits[kept] / TEMPERATURE, dim=-1)
    kl = F.kl_div(log_student, log_teacher, reduction="sum", log_target=True)
    return ce, kl


def train(step_fn, student, optimizer_name: str) -> list[list[float]]:
    """``step_fn`` (the micro-batch: the [loss, CE, KL] means, the loss differentiated) then the
    optimizer's update, :data:`STEPS` times."""
    optimizer = OPTIMIZERS[optimizer_name](list(student.parameters()))
    rows = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        rows.append(step_fn().tolist())
        optimizer.step()
    return rows


@pytest.mark.parametrize(
    ("alpha", "optimizer_name"), [(0.0, "sgd"), (0.5, "sgd"), (1.0, "sgd"), (0.5, "adamw")]
)
def test_distillation_step_equals_plain_pytorch(alpha, optimizer_name):
    student, teacher = models()
    twin, data = copy.deepcopy(student), batch()
    tokens = int((data.labels[:, 1:] != -100).sum())
    teacher_before = copy.deepcopy(teacher.state_dict())
    options = dict(alpha=alpha, temperature=TEMPERATURE, compute=nullcontext, chunk_tokens=CHUNK)
    step = DistillStep(teacher=teacher, **options)

    def ours() -> torch.Tensor:
        return distill_forward_backward(student, data, tokens, step) / tokens

    def reference() -> torch.Tensor:
        ce, kl = reference_sums(twin, teacher, data)
        loss = (alpha * ce + (1 - alpha) * TEMPERATURE**2 * kl) / tokens
        loss.backward()
        return torch.stack([loss, ce / tokens, kl / tokens]).detach()

    got, want = train(ours, student, optimizer_name), train(reference, twin, optimizer_name)
    assert torch.tensor(got).sub(torch.tensor(want)).abs().max().item() <= 1e-5, (got, want)
    trained = 0 if alpha == 0 else 1 if alpha == 1 else None  # the term that is the whole loss
    losses = [row[0] for row in got]
    assert losses[-1] < losses[0] - 1e-3  # it trains: the comparison is of moving values
    if trained is not None:  # alpha 1: the loss is CE; alpha 0: T² · KL
        weight = 1.0 if alpha == 1 else TEMPERATURE**2
        assert got[0][0] == pytest.approx(weight * got[0][1 + (alpha == 0)], rel=1e-6)
    assert all(p.grad is None for p in teacher.parameters())
    after = teacher.state_dict()
    assert all(torch.equal(after[name], value) for name, value in teacher_before.items())
