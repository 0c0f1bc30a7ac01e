"""The free sync called once per step on the same model: it keeps its plan and buffers while the
model stays as it is, rebuilds them exactly when the model changes, and the copies stay exactly
equal on every rank after each change.

Whether the plan and buffers were kept shows in behaviour: after a sync the FP32 gradients are
views of the plan's persistent bucket, and a rebuilt plan hands out views of a new one. Values are
small integers and halves, so every comparison is exact.
"""

from contextlib import contextmanager
from unittest.mock import patch

import torch
from torch import nn

from components.distributed.tp_replicas import (
    _MODEL_OWNED_GRAD_DIVISOR_ATTR,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
    zero_tp_replica_gradients,
)
from tests.distributed.common import Holder, recorded_collectives
from tests.harness import mesh


def grads_of(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.grad.tolist() for name, p in model.named_parameters() if p.grad is not None}


def give_grads(model: nn.Module, rank: int) -> None:
    """Each rank its own gradient, fresh tensors (as after ``zero_grad()``): rank + 1 everywhere."""
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, float(rank + 1))


def check_changes(rank, world_size):
    model = nn.Module()
    model.a = Holder(torch.zeros(4))
    device_mesh = mesh((world_size,), ("tp",))
    steps, buckets = [], []

    def sync(label: str) -> None:
        count = synchronize_tp_replica_gradients([model], device_mesh)
        buckets.append(model.a.weight.grad._base)  # the bucket a's gradient is now a view of
        kept = len(buckets) > 1 and buckets[-1] is buckets[-2]
        steps.append((label, count, kept, grads_of(model)))

    def step(label: str) -> None:
        give_grads(model, rank)
        sync(label)

    step("first")
    step("steady")  # nothing changed: the plan and its bucket are kept
    model.a.weight.grad = torch.full((4,), float(rank + 1))  # a gradient re-bound: packed, kept
    sync("grad rebound")
    model.b = Holder(torch.zeros(2))  # a parameter added
    step("added")
    model.a.weight = nn.Parameter(torch.zeros(3))  # a parameter replaced
    step("replaced")
    mark_tp_replica_gradient_reduction(model.b, "sum")  # a marker set after the build
    step("marked sum")
    model.double()  # a dtype cast: the same parameters, new storage; the buffers follow
    step("cast")
    dtypes = [p.grad.dtype for p in model.parameters()]
    setattr(model.b.weight, _MODEL_OWNED_GRAD_DIVISOR_ATTR, 2)  # b is now the model's own shard
    step("owned")
    return steps, dtypes


def test_the_plan_is_kept_while_the_model_stays_and_rebuilt_when_it_changes(ranks2):
    results = ranks2.run(check_changes)
    (steps, dtypes), (other_steps, _) = results
    mean, total = 1.5, 3.0  # mean(1, 2) and sum(1, 2)
    expected = [
        ("first", 1, False, {"a.weight": [mean] * 4}),
        ("steady", 1, True, {"a.weight": [mean] * 4}),
        ("grad rebound", 1, True, {"a.weight": [mean] * 4}),
        ("added", 2, False, {"a.weight": [mean] * 4, "b.weight": [mean] * 2}),
        ("replaced", 2, False, {"a.weight": [mean] * 3, "b.weight": [mean] * 2}),
        ("marked sum", 2, False, {"a.weight": [mean] * 3, "b.weight": [total] * 2}),
        ("cast", 2, False, {"a.weight": [mean] * 3, "b.weight": [total] * 2}),
    ]
    assert steps[:-1] == other_steps[:-1] == expected  # every replica identical on both ranks
    # once b is model-owned it is left alone: each rank keeps its own gradient (rank + 1)
    for rank, (label, count, kept, grads) in enumerate([steps[-1], other_steps[-1]]):
        assert (label, count, kept) == ("owned", 1, False)
        assert grads == {"a.weight": [mean] * 3, "b.weight": [rank + 1.0] * 2}
    assert dtypes == [torch.float64] * 2


def check_in_place_across_steps(rank, world_size):
    model = nn.Module()
    model.a = Holder(torch.zeros(4))
    model.b = Holder(torch.zeros(2))
    device_mesh = mesh((world_size,), ("tp",))
    give_grads(model, rank)
    synchronize_tp_replica_gradients([model], device_mesh)
    views = [model.a.weight.grad, model.b.weight.grad]
    bucket = views[0]._base
    results = []
    # autograd accumulates into the bucket views, as with zero_grad(set_to_none=False)
    for _ in range(3):
        for grad in views:
            grad.zero_().add_(rank + 1)
        with recorded_collectives() as calls:
            count = synchronize_tp_replica_gradients([model], device_mesh)
        results.append((count, grads_of(model), calls))
    same = [grad is p.grad for grad, p in zip(views, model.parameters(), strict=True)]
    return results, same, [grad._base is bucket for grad in views]


def test_the_free_sync_reduces_in_place_step_after_step_in_one_bucket(ranks2):
    calls = [("all_reduce", torch.int32, 6), ("all_reduce", torch.float32, 6)]
    for results, same, in_bucket in ranks2.run(check_in_place_across_steps):
        assert results == [(2, {"a.weight": [1.5] * 4, "b.weight": [1.5] * 2}, calls)] * 3
        assert same == [True, True] and in_bucket == [True, True]


# --- the recipe's step: zero_grad(set_to_none=True), bind the buckets, backward, sync ------------


@contextmanager
def recorded_copies():
    """Count the packing and unpacking calls made inside (``torch._foreach_copy_``, ``cat``)."""
    counts = {"_foreach_copy_": 0, "cat": 0}

    def counting(name):
        original = getattr(torch, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    with patch.multiple(torch, **{name: counting(name) for name in counts}):
        yield counts


def in_slot(grad: torch.Tensor | None, slot: torch.Tensor | None) -> bool | None:
    """Whether the gradient is the same memory as the slot bound before the backward."""
    if slot is None:
        return None
    return grad is not None and grad.data_ptr() == slot.data_ptr()


def check_bound_steps(rank, world_size):
    model = nn.Module()
    for name in ("a", "b", "c"):
        setattr(model, name, Holder(torch.zeros(2 if name == "b" else 4)))
    mark_tp_replica_gradient_reduction(model.b, "sum")
    holders, device_mesh = (model.a, model.b, model.c), mesh((world_size,), ("tp",))
    steps = []

    def step(reached: str, replace_a: bool = False) -> None:
        model.zero_grad(set_to_none=True)  # as the recipe's optimizer.zero_grad() does
        bound = zero_tp_replica_gradients([model], device_mesh)
        slots = [holder.weight.grad for holder in holders]
        # each holder's gradient is (rank + 1) * its scale: a 1, b 2, c 3
        loss = sum(
            (getattr(model, name).weight * (rank + 1) * scale).sum()
            for name, scale in zip("abc", (1, 2, 3), strict=True)
            if name in reached
        )
        loss.backward()
        held = None
        if replace_a:  # a gradient replaced after the backward: packed, reduced in place
            held = model.a.weight.grad = torch.full((4,), float(rank + 1))
        with recorded_collectives() as calls, recorded_copies() as copies:
            count = synchronize_tp_replica_gradients([model], device_mesh)
        in_slots = [in_slot(h.weight.grad, slot) for h, slot in zip(holders, slots, strict=True)]
        held_result = None if held is None else held.tolist()
        steps.append((bound, count, grads_of(model), calls, copies, in_slots, held_result))
        with torch.no_grad():  # SGD, lr 0.5 (torch.optim's first step imports torch._dynamo)
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.sub_(0.5 * parameter.grad)

    step("abc")  # the first step builds the buckets: nothing to bind yet
    step("abc")  # the backward accumulates into the buckets: no copy
    step("ab")  # c not reached: its gradient is None again, as zero_grad left it
    step("abc", replace_a=True)
    try:
        step("abc" if rank == 0 else "ab")  # c reached on one rank only
    except RuntimeError as error:
        steps.append(str(error))
    return steps, [p.tolist() for p in model.parameters()]


def test_bound_buckets_take_the_backward_and_the_sync_copies_nothing(ranks2):
    mean_a, sum_b, mean_c = [1.5] * 4, [6.0] * 2, [4.5] * 4
    grads = {"a.weight": mean_a, "b.weight": sum_b, "c.weight": mean_c}
    collectives = [("all_reduce", torch.int32, 9)]  # the pre-check, then the mean and sum buckets
    collectives += [("all_reduce", torch.float32, 8), ("all_reduce", torch.float32, 2)]
    no_copies = {"_foreach_copy_": 0, "cat": 0}
    results = ranks2.run(check_bound_steps)
    for steps, parameters in results:
        first, steady, not_reached, replaced, presence = steps
        assert first[:4] == (0, 3, grads, collectives) and first[4] != no_copies
        assert first[5] == [None] * 3  # nothing was bound
        assert steady == (3, 3, grads, collectives, no_copies, [True] * 3, None)
        without_c = {"a.weight": mean_a, "b.weight": sum_b}
        assert not_reached[:3] == (3, 2, without_c) and not_reached[5] == [True, True, False]
        assert replaced[:3] == (3, 3, grads) and replaced[5:] == ([True] * 3, mean_a)
        assert presence == "Gradient presence differs across TP replicas: c.weight"
        # four SGD updates of lr 0.5 (c three): exactly equal on both ranks
        assert parameters == [[-3.0] * 4, [-12.0] * 2, [-6.75] * 4]


def check_bind_after_a_cast(rank, world_size):
    model = nn.Module()
    model.a = Holder(torch.zeros(4))
    device_mesh = mesh((world_size,), ("tp",))
    bound, unbound = [], []
    for cast in (False, False, True, False):
        if cast:
            model.double()  # new storage of another dtype: the slots no longer fit until rebuilt
            model.a.weight.grad = torch.ones(4, dtype=torch.float64)  # zero_grad(set_to_none=False)
        else:
            model.zero_grad(set_to_none=True)
        bound.append(zero_tp_replica_gradients([model], device_mesh))
        unbound.append(model.a.weight.grad is None)
        (model.a.weight * (rank + 1)).sum().backward()
        synchronize_tp_replica_gradients([model], device_mesh)
    return bound, unbound, model.a.weight.grad.dtype, model.a.weight.grad.tolist()


def test_a_cast_model_is_not_bound_until_its_buckets_follow(ranks2):
    """A parameter that no longer fits its slot binds nothing and is left without a gradient, as
    ``zero_grad(set_to_none=True)`` leaves it, so its backward starts from zero."""
    for bound, unbound, dtype, grad in ranks2.run(check_bind_after_a_cast):
        assert (bound, unbound) == ([0, 1, 0, 1], [True, False, True, False])
        assert (dtype, grad) == (torch.float64, [1.5] * 4)
