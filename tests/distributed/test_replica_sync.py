"""ReplicaSync held across steps: what rebuilds its plan (by itself or through ``refresh()``) and
that the copies stay exactly equal on every rank after each change.

Values are small integers and halves, so every comparison is exact.
"""

import torch
from torch import nn

from components.distributed.replicas.sync import ReplicaSync
from components.distributed.tp_replicas import (
    _MODEL_OWNED_GRAD_DIVISOR_ATTR,
    mark_tp_replica_gradient_reduction,
)
from tests.distributed.common import Holder
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
    replicas = ReplicaSync([model], mesh((world_size,), ("tp",)))
    steps = []

    def step(label: str) -> None:
        give_grads(model, rank)
        count = replicas.synchronize()
        steps.append((label, count, replicas.plans_built, grads_of(model)))

    step("first")
    step("steady")  # nothing changed: the plan is kept
    model.a.weight.grad = torch.full((4,), float(rank + 1))  # a gradient re-bound: kept, packed
    replicas.synchronize()
    steps.append(("grad rebound", 1, replicas.plans_built, grads_of(model)))
    model.b = Holder(torch.zeros(2))  # a parameter added
    step("added")
    model.a.weight = nn.Parameter(torch.zeros(3))  # a parameter replaced
    step("replaced")
    mark_tp_replica_gradient_reduction(model.b, "sum")  # a marker set after the build
    step("marked sum")
    model.double()  # a dtype cast: the same parameters, new storage; the buffers follow
    step("cast")
    dtypes = [p.grad.dtype for p in model.parameters()]
    setattr(model.b.weight, _MODEL_OWNED_GRAD_DIVISOR_ATTR, 2)  # only refresh() sees this one
    step("owned, not refreshed")
    replicas.refresh()
    step("owned, refreshed")
    return steps, dtypes


def test_a_held_sync_rebuilds_its_plan_exactly_when_the_model_changes(ranks2):
    results = ranks2.run(check_changes)
    (steps, dtypes), (other_steps, _) = results
    mean, total = 1.5, 3.0  # mean(1, 2) and sum(1, 2)
    expected = [
        ("first", 1, 1, {"a.weight": [mean] * 4}),
        ("steady", 1, 1, {"a.weight": [mean] * 4}),
        ("grad rebound", 1, 1, {"a.weight": [mean] * 4}),
        ("added", 2, 2, {"a.weight": [mean] * 4, "b.weight": [mean] * 2}),
        ("replaced", 2, 3, {"a.weight": [mean] * 3, "b.weight": [mean] * 2}),
        ("marked sum", 2, 4, {"a.weight": [mean] * 3, "b.weight": [total] * 2}),
        ("cast", 2, 4, {"a.weight": [mean] * 3, "b.weight": [total] * 2}),
        ("owned, not refreshed", 2, 4, {"a.weight": [mean] * 3, "b.weight": [total] * 2}),
    ]
    assert steps[:-1] == other_steps[:-1] == expected  # every replica identical on both ranks
    # after refresh() the model-owned gradient is left alone: each rank keeps its own (rank + 1)
    for rank, (label, count, built, grads) in enumerate([steps[-1], other_steps[-1]]):
        assert (label, count, built) == ("owned, refreshed", 1, 5)
        assert grads == {"a.weight": [mean] * 3, "b.weight": [rank + 1.0] * 2}
    assert dtypes == [torch.float64] * 2


def check_in_place_across_steps(rank, world_size):
    model = nn.Module()
    model.a = Holder(torch.zeros(4))
    model.b = Holder(torch.zeros(2))
    replicas = ReplicaSync([model], mesh((world_size,), ("tp",)))
    give_grads(model, rank)
    replicas.synchronize()
    views = [model.a.weight.grad, model.b.weight.grad]
    results = []
    # autograd accumulates into the bucket views, as with zero_grad(set_to_none=False)
    for _ in range(3):
        for grad in views:
            grad.zero_().add_(rank + 1)
        results.append((replicas.synchronize(), grads_of(model)))
    same = [grad is p.grad for grad, p in zip(views, model.parameters(), strict=True)]
    return results, same, replicas.plans_built


def test_a_held_sync_reduces_in_place_step_after_step_with_one_plan(ranks2):
    for results, same, built in ranks2.run(check_in_place_across_steps):
        assert results == [(2, {"a.weight": [1.5] * 4, "b.weight": [1.5] * 2})] * 3
        assert same == [True, True] and built == 1
