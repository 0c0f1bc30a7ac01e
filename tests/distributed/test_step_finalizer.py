"""The run's gradient finalisation: the first step checks presence (a read) and learns the Partial
gradients; later steps sum them in the same buffers with no read, the presence counts riding in
the buffer, and anything amiss is raised on every rank once the readout hands the largest count
back."""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from components.distributed.grads import finalize_dtensor_gradients, grad_norm
from components.distributed.step_finalizer import StepFinalizer
from components.training.readout import StepReadout
from tests.distributed.common import Holder, recorded_collectives
from tests.harness import mesh

READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")


@contextmanager
def counted_reads():
    """Every read of a tensor's value on the host while inside."""
    reads, originals = [], {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(*args, **kwargs):
            reads.append(name)
            return originals[name](*args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def norms_model(tp, rank: int, step: int, names=("norm", "q_norm")) -> nn.Module:
    """Replicate parameters (sequence-parallel norms) with Partial gradients that differ by rank
    and step; ``sharded`` a Shard parameter whose gradient needs nothing."""
    model = nn.Module()
    for index, name in enumerate(names):
        holder = Holder(distribute_tensor(torch.zeros(3), tp, [Replicate()]))
        local = torch.arange(3.0) * (rank + 1) + 10 * step + index
        holder.weight.grad = DTensor.from_local(local, tp, [Partial()])
        setattr(model, name, holder)
    model.sharded = Holder(distribute_tensor(torch.zeros(4), tp, [Shard(0)]))
    model.sharded.weight.grad = DTensor.from_local(torch.full((2,), float(rank)), tp, [Shard(0)])
    return model


def regrad(model: nn.Module, fresh: nn.Module) -> None:
    """Hand ``model``'s parameters ``fresh``'s gradients (a new backward on the same parameters)."""
    for (_, parameter), (_, new) in zip(
        model.named_parameters(), fresh.named_parameters(), strict=True
    ):
        parameter.grad = new.grad


def grads(model: nn.Module) -> dict:
    return {
        name: (p.grad.placements, p.grad.to_local().tolist())
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def largest(problems) -> float:
    """What the readout hands back: the largest count over every rank."""
    wire = torch.tensor([float(problems)])
    dist.all_reduce(wire, op=dist.ReduceOp.MAX)
    return wire.item()


def check_later_steps_read_nothing(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    finalizer, model = StepFinalizer(), norms_model(tp, rank, step=0)
    with counted_reads() as first_reads, recorded_collectives() as first_calls:
        first = finalizer([model])
    assert int(finalizer.problems()) == 0
    out = []
    for step in (1, 2):
        regrad(model, norms_model(tp, rank, step))
        with counted_reads() as reads, recorded_collectives() as calls:
            changed = finalizer([model])
            problems = finalizer.problems()
        expected = norms_model(tp, rank, step)
        finalize_dtensor_gradients([expected])
        out.append((changed, reads, len(calls), grads(model) == grads(expected), float(problems)))
        finalizer.verify(largest(problems))
    return first, len(first_reads) > 0, len(first_calls), out


def test_the_first_step_learns_and_later_steps_read_nothing(ranks2):
    for first, first_read, first_calls, later in ranks2.run(check_later_steps_read_nothing):
        assert (first, first_read, first_calls) == (2, True, 2)  # the presence check, the sum
        assert later == [(2, [], 1, True, 0.0)] * 2  # one all-reduce: the gradients and counts


def check_missing_later(rank, world_size):
    """Through the step's readout: its one read carries the count, every rank raises."""
    tp = mesh((world_size,), ("tp",))
    finalize = StepFinalizer()
    readout, model = StepReadout(None, torch.device("cpu"), finalize), norms_model(tp, rank, step=0)
    finalize([model])
    regrad(model, norms_model(tp, rank, step=1))
    if rank == 1:
        model.q_norm.weight.grad = None  # unused by this rank's forward at this step
    with counted_reads() as reads:
        finalize([model])
    summed = model.norm.weight.grad  # the others are summed as ever, on both ranks
    zero = torch.zeros((), dtype=torch.float64)
    with pytest.raises(RuntimeError) as error:
        readout.read(zero, zero, False, None)
    return reads, str(error.value), summed.placements, summed.to_local().tolist()


def test_a_gradient_missing_on_one_rank_later_raises_on_every_rank_with_its_name(ranks2):
    expected = ([], "Gradient presence differs across ranks: q_norm.weight", (Replicate(),))
    for reads, message, placements, summed in ranks2.run(check_missing_later, timeout_s=20):
        assert (reads, message, placements) == expected
        assert summed == [20.0, 23.0, 26.0]  # (10, 11, 12) + (10, 12, 14)


def check_missing_everywhere_later(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    finalizer, model = StepFinalizer(), norms_model(tp, rank, step=0)
    finalizer([model])
    regrad(model, norms_model(tp, rank, step=1))
    model.q_norm.weight.grad = None  # unused by every rank's forward at this step
    changed = finalizer([model])
    expected = norms_model(tp, rank, step=1)
    expected.q_norm.weight.grad = None
    finalize_dtensor_gradients([expected])
    finalizer.verify(largest(finalizer.problems()))  # nothing amiss: no raise
    return changed, model.q_norm.weight.grad is None, grads(model) == grads(expected)


def test_a_gradient_missing_on_every_rank_later_stays_missing_and_is_no_problem(ranks2):
    assert ranks2.run(check_missing_everywhere_later) == [(1, True, True)] * 2


def check_unlearned_gradient(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    finalizer, model = StepFinalizer(), norms_model(tp, rank, step=0)
    model.late = Holder(distribute_tensor(torch.zeros(3), tp, [Replicate()]))
    finalizer([model])  # ``late`` has no gradient yet
    fresh = norms_model(tp, rank, step=1)
    for name in ("norm", "q_norm", "sharded"):
        regrad(getattr(model, name), getattr(fresh, name))
    model.late.weight.grad = DTensor.from_local(torch.ones(3), tp, [Partial()])
    finalizer([model])
    late = model.late.weight.grad
    norm = grad_norm([model])  # the step goes on to the readout on every rank
    with pytest.raises(RuntimeError) as error:
        finalizer.verify(largest(finalizer.problems()))
    return str(error.value), late.placements, late.to_local().tolist(), torch.isfinite(norm).item()


def test_a_gradient_first_made_after_the_first_step_is_refused_on_every_rank(ranks2):
    message = (
        "gradient placements, dtypes or shapes differ from the first step's, which finalisation "
        "learns them from (a parameter first used after it is not supported): late.weight"
    )
    assert (
        ranks2.run(check_unlearned_gradient, timeout_s=20)
        == [(message, (Replicate(),), [0.0] * 3, True)] * 2
    )


def check_redistributed_is_learned_again(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    finalizer, reads, model = StepFinalizer(), [], norms_model(tp, rank, step=0)
    model.wrong = Holder(distribute_tensor(torch.zeros(4), tp, [Shard(0)]))
    for step in range(2):  # the same parameters: only the redistribute makes it learn again
        for name in ("norm", "q_norm", "sharded"):
            regrad(getattr(model, name), getattr(norms_model(tp, rank, step), name))
        model.wrong.weight.grad = distribute_tensor(torch.arange(4.0), tp, [Replicate()])
        with counted_reads() as step_reads:
            finalizer([model])
        reads.append(len(step_reads) > 0)
    return reads, model.wrong.weight.grad.placements


def test_a_step_that_redistributes_checks_again_at_the_next(ranks2):
    # a redistribute is a collective per gradient: nothing to zero-fill, so presence is asked
    assert ranks2.run(check_redistributed_is_learned_again) == [([True, True], (Shard(0),))] * 2
