"""DPO's micro-batch at tp=2 (gloo): a tiny Llama policy and its frozen reference each split by
the family's plan (the head ``vocab_parallel``), with and without sp, give the tp=1 models' metric
sums and the policy's gradients within 1e-5; and a spy on every op's output shows that no tensor
of the vocabulary's whole width is made, forward or backward: each rank holds its half."""

from contextlib import nullcontext

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from components.data.loader import Batch
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.tp_plan import apply_tp_plan
from components.models import build_causal_lm
from components.models.families import plan_for
from components.training.preference import DpoOptions, DpoStep, dpo_forward_backward
from recipes.tiny_models import tiny_config
from tests.distributed.test_post_training_losses import Widths as _AllWidths
from tests.distributed.test_post_training_losses import full
from tests.harness import mesh
from tests.unit.training.test_chunked_loss import batch, relative


class _Widths(_AllWidths):
    """The last dimension of every tensor an op makes, and the shape of each that is as wide as
    ``vocab`` and held whole on the rank (a DTensor's shape is its global one, each rank holding
    its shard: the mode sees the op before DTensor runs it on the local shards)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.whole = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for tensor in tree_leaves(out):
            whole = isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor)
            if whole and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.whole.add(tuple(tensor.shape))
        return out


TOLERANCE = 1e-5


def pairs_batch(vocab: int) -> Batch:
    """Two pairs: rows 0, 1 chosen, rows 2, 3 rejected, prompts unlabelled, padding at the end."""
    tokens, labels = batch(vocab, rows=4, seq=24)
    labels[:, :6] = -100
    tokens[2:, :6] = tokens[:2, :6]  # each pair one prompt
    positions = torch.arange(24).expand(4, 24)
    return Batch(
        input_ids=tokens, labels=labels, position_ids=positions, real_tokens=torch.full((4,), 24)
    )


def models(tp_mesh, sequence_parallel: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config("llama")
    policy, reference = build_causal_lm(config, seed=0), build_causal_lm(config, seed=1)
    reference.requires_grad_(False)
    if tp_mesh is not None:
        for model in (policy, reference):
            plan = plan_for(config, sequence_parallel)
            apply_tp_plan(model, tp_mesh, plan, config, sequence_parallel)
    return policy, reference.eval()


def check_dpo_step(rank, world_size, sequence_parallel, loss_type):
    tp_mesh = mesh((world_size,), ("tp",))
    options = DpoOptions(beta=0.5, loss_type=loss_type)
    results = {}
    for name, layout in (("whole", None), ("split", tp_mesh)):
        policy, reference = models(layout, sequence_parallel)
        step = DpoStep(options=options, compute=nullcontext, chunk_tokens=5, reference=reference)
        pairs = pairs_batch(policy.config.vocab_size)
        with _Widths(policy.config.vocab_size) if layout else nullcontext() as spy:
            sums = dpo_forward_backward(policy, pairs, 2, step)
        if layout is not None:
            finalize_dtensor_gradients([policy])
        grads = {n: full(p.grad) for n, p in policy.named_parameters() if p.grad is not None}
        results[name] = (sums, grads, spy)
    (want, want_grads, _), (got, got_grads, spy) = results["whole"], results["split"]
    errors = {"sums": relative(got, want)}
    errors |= {name: relative(got_grads[name], want_grads[name]) for name in want_grads}
    return errors, spy, policy.config.vocab_size


@pytest.mark.parametrize(("sequence_parallel", "loss_type"), [(False, "sigmoid"), (True, "ipo")])
def test_dpo_step_at_tp2_equals_tp1_and_never_holds_the_whole_vocabulary(
    ranks2, sequence_parallel, loss_type
):
    for errors, spy, vocab in ranks2.run(check_dpo_step, sequence_parallel, loss_type):
        assert max(errors.values()) <= TOLERANCE, max(errors.items(), key=lambda e: e[1])
        assert vocab // 2 in spy.seen  # each rank its half's logits, and of the whole width only
        assert not spy.whole, spy.whole
