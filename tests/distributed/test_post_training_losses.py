"""The post-training losses at tp=2 (gloo) equal tp=1 within 1e-5, values and gradients: the
answer tokens' log-probabilities (DPO's) and the distillation sums, the head's weight a
``Shard(0)`` DTensor over the TP mesh (``vocab_parallel``), the hidden states replicated (plain
TP) or sequence-sharded (sp), a LoRA adapter on the head (its ``B`` split as the weight). The
tp=1 run is the same function in one process on the whole weight. At tp=2 a spy on every op's
output shows that no tensor of the vocabulary's whole width is made, forward or backward. And
distillation of real tiny models (a Llama student, LoRA on its head and q_proj, a wider, deeper
Llama teacher), each parallelised by its plan, equals the tp=1 models' own whole logits under
``F.cross_entropy`` and ``F.kl_div``."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from components.distributed.chunked_distillation import (
    chunked_distillation_sums,
    distillation_loss,
)
from components.distributed.chunked_loss import (
    chunked_head,
    chunked_token_log_probs,
    head_weights,
    lm_head_skipped,
)
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import synchronize_tp_replica_gradients
from components.models import build_causal_lm
from components.models.families import plan_for
from recipes.tiny_models import tiny_config
from tests.distributed.test_chunked_loss import HEAD_LORA
from tests.harness import mesh
from tests.unit.training.test_chunked_loss import batch, relative, with_trained_adapters
from tests.unit.training.test_post_training_losses import (
    HIDDEN,
    RANK,
    TEACHER_HIDDEN,
    VOCAB,
    adapter_of,
    reference_distillation,
)

TOLERANCE = 1e-5


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def student(tp_mesh, sequence_parallel: bool, lora: bool) -> dict:
    """The student's leaves, seeded alike on every rank: whole (tp=1) and split over ``tp_mesh``."""
    generator = torch.Generator().manual_seed(1)
    whole = {
        "hidden": torch.randn(2, 40, HIDDEN, generator=generator),
        "weight": torch.randn(VOCAB, HIDDEN, generator=generator),
        "A": torch.randn(RANK, HIDDEN, generator=generator),
        "B": torch.randn(VOCAB, RANK, generator=generator) * 0.3,
    }
    split = {
        "hidden": distribute_tensor(whole["hidden"], tp_mesh, [Shard(1)])
        if sequence_parallel
        else whole["hidden"].clone(),
        "weight": distribute_tensor(whole["weight"], tp_mesh, [Shard(0)]),
        "A": whole["A"].clone(),
        "B": distribute_tensor(whole["B"], tp_mesh, [Shard(0)]),
    }
    if not lora:
        del whole["A"], whole["B"], split["A"], split["B"]
    for leaves in (whole, split):
        for leaf in leaves.values():
            leaf.requires_grad_()
    return {"whole": whole, "split": split}


class Widths(TorchDispatchMode):
    """The last dimension of every tensor an op makes on this rank while the mode is on: a plain
    tensor's, and a DTensor's local shard's (its global shape is a description; the shard is what
    the rank holds). A logits tensor's is the vocabulary it holds."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if isinstance(local, torch.Tensor) and local.dim():
                self.seen.add(local.shape[-1])
        return out


def run_split(name: str, run) -> tuple:
    """``run()``, its forward and backward under a :class:`Widths` spy for the split run; the
    result and the widths seen (None for the whole run)."""
    if name == "whole":
        return run(), None
    with Widths() as spy:
        result = run()
    return result, spy.seen


def head(leaves: dict):
    adapter = adapter_of(leaves["A"], leaves["B"]) if "A" in leaves else None
    return leaves["hidden"], leaves["weight"], adapter


def errors(got: dict, want: dict, loss, reference) -> dict[str, float]:
    """Relative errors of the loss and of every leaf's gradient, the tp=2 ones made whole. ``A``
    is whole on each rank and its gradient partial (each rank's vocabulary shard's part), summed
    over the TP group as the model's gradient finalisation does."""
    if "A" in got:
        dist.all_reduce(got["A"].grad)
    result = {"loss": relative(loss.detach(), reference.detach())}
    for name, leaf in got.items():
        result[name] = relative(full(leaf.grad), want[name].grad)
    return result


def check_log_probs(rank, world_size, sequence_parallel, lora):
    leaves = student(mesh((world_size,), ("tp",)), sequence_parallel, lora)
    _, labels = batch(VOCAB)
    upstream = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    results = []
    for name in ("whole", "split"):

        def run(name=name):
            logps = chunked_token_log_probs(chunked_head(*head(leaves[name])), labels, 8)
            (logps * upstream).sum().backward()
            return logps.sum(-1)  # the sequences' log-probabilities, DPO's

        results.append(run_split(name, run))
    (reference, _), (sequences, widths) = results
    return errors(leaves["split"], leaves["whole"], sequences, reference), widths


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_log_probs_at_tp2_equal_tp1(ranks2, sequence_parallel, lora):
    for result, widths in ranks2.run(check_log_probs, sequence_parallel, lora):
        assert max(result.values()) <= TOLERANCE, result
        assert VOCAB // 2 in widths and VOCAB not in widths  # each rank its half's logits only


def check_distillation(rank, world_size, sequence_parallel, lora, temperature):
    tp_mesh = mesh((world_size,), ("tp",))
    leaves = student(tp_mesh, sequence_parallel, lora)
    generator = torch.Generator().manual_seed(3)
    teacher_hidden = torch.randn(2, 40, TEACHER_HIDDEN, generator=generator)
    teacher_weight = torch.randn(VOCAB, TEACHER_HIDDEN, generator=generator)
    teachers = {
        "whole": (teacher_hidden, teacher_weight),
        "split": (
            distribute_tensor(teacher_hidden, tp_mesh, [Shard(1)])
            if sequence_parallel
            else teacher_hidden,
            distribute_tensor(teacher_weight, tp_mesh, [Shard(0)]),
        ),
    }
    _, labels = batch(VOCAB)
    results = []
    for name in ("whole", "split"):

        def run(name=name):
            hidden, weight, adapter = head(leaves[name])
            ce, kl = chunked_distillation_sums(
                hidden, weight, *teachers[name], labels, temperature, 8, adapter=adapter
            )
            distillation_loss(ce, kl, 57, 0.5, temperature).backward()
            return torch.stack([ce, kl])

        results.append(run_split(name, run))
    (reference, _), (sums, widths) = results
    return errors(leaves["split"], leaves["whole"], sums, reference), widths


@pytest.mark.parametrize(
    "sequence_parallel, lora, temperature",
    [(False, False, 2.0), (True, True, 2.0), (False, True, 1.0)],
)
def test_distillation_at_tp2_equals_tp1(ranks2, sequence_parallel, lora, temperature):
    for result, widths in ranks2.run(check_distillation, sequence_parallel, lora, temperature):
        assert max(result.values()) <= TOLERANCE, result
        assert VOCAB // 2 in widths and VOCAB not in widths  # each rank its half's logits only


def check_split_teacher_refused(rank, world_size):
    tp_mesh = mesh((world_size,), ("tp",))
    weight = distribute_tensor(torch.randn(VOCAB, HIDDEN), tp_mesh, [Shard(0)])
    _, labels = batch(VOCAB)
    try:
        chunked_distillation_sums(
            torch.randn(2, 40, HIDDEN), weight, torch.randn(2, 40, 4), torch.randn(VOCAB, 4),
            labels, 1.0,
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    return None


def test_a_teacher_head_split_otherwise_is_refused(ranks2):
    for message in ranks2.run(check_split_teacher_refused):
        assert message.startswith("the teacher's head must be split over the vocabulary as the")


def distil_models(tp_mesh, sequence_parallel: bool, lora: bool):
    """A tiny Llama student (LoRA on its head and q_proj, B non-zero as after training) and a
    wider, deeper teacher of the same vocabulary; both parallelised by their plans on ``tp_mesh``
    (None: tp=1, whole)."""
    student_config = tiny_config("llama")
    teacher_config = tiny_config(
        "llama",
        hidden_size=2 * student_config.hidden_size,
        intermediate_size=2 * student_config.intermediate_size,
        num_hidden_layers=student_config.num_hidden_layers + 1,
    )
    student = build_causal_lm(student_config, seed=0)
    teacher = build_causal_lm(teacher_config, seed=1).requires_grad_(False)
    if lora:
        with_trained_adapters(student, HEAD_LORA)
    if tp_mesh is not None:
        for model, config in ((student, student_config), (teacher, teacher_config)):
            apply_tp_plan(
                model, tp_mesh, plan_for(config, sequence_parallel), config, sequence_parallel
            )
    return student, teacher


def check_models(rank, world_size, sequence_parallel, lora, alpha, temperature):
    """tp=2 chunked (the model's hidden states, its heads) against tp=1's own logits: the
    whole-vocabulary reference (``F.cross_entropy`` and ``F.kl_div``), loss and every gradient."""
    tp_mesh = mesh((world_size,), ("tp",))
    student, teacher = distil_models(None, sequence_parallel, lora)
    tokens, labels = batch(student.config.vocab_size, seq=48)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=tokens, use_cache=False).logits
    ce, kl = reference_distillation(
        student(input_ids=tokens, use_cache=False).logits, teacher_logits, labels, temperature
    )
    tokens_labelled = int((labels[:, 1:] != -100).sum())
    reference = distillation_loss(ce, kl, tokens_labelled, alpha, temperature)
    reference.backward()
    want = {name: p.grad for name, p in student.named_parameters() if p.grad is not None}

    student, teacher = distil_models(tp_mesh, sequence_parallel, lora)
    with torch.no_grad(), lm_head_skipped(teacher) as teacher_head:
        teacher_hidden = teacher(input_ids=tokens, use_cache=False).logits
    with lm_head_skipped(student) as head:
        hidden = student(input_ids=tokens, use_cache=False).logits
    weights = head_weights(head)
    ce, kl = chunked_distillation_sums(
        hidden, weights.weight, teacher_hidden, teacher_head.weight, labels, temperature, 8,
        adapter=weights.adapter,
    )  # fmt: skip
    loss = distillation_loss(ce, kl, tokens_labelled, alpha, temperature)
    loss.backward()
    finalize_dtensor_gradients([student])  # then the adapters' A, partial per rank, summed
    synchronize_tp_replica_gradients([student], tp_mesh)  # as the recipe's step does
    got = {name: full(p.grad) for name, p in student.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    result = {name: relative(got[name], want[name]) for name in got}
    result["loss"] = relative(loss.detach(), reference.detach())
    return result


@pytest.mark.parametrize(
    "sequence_parallel, lora, alpha, temperature",
    [(False, False, 0.5, 2.0), (True, True, 0.25, 1.5)],
)
def test_distilling_tp2_models_equals_tp1_whole_logits(
    ranks2, sequence_parallel, lora, alpha, temperature
):
    for result in ranks2.run(check_models, sequence_parallel, lora, alpha, temperature):
        assert max(result.values()) <= TOLERANCE, max(result.items(), key=lambda item: item[1])
