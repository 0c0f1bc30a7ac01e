"""ReplicaSyncOverlap on real gloo ranks: the same updates as the boundary sync, errors on every
rank together."""

import pytest
import torch
from torch import nn

from components.distributed.replica_sync_overlap import ReplicaSyncOverlap
from components.distributed.tp_replicas import (
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)
from tests.harness import mesh


def small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 3))
    model[2].to(torch.bfloat16)
    mark_tp_replica_gradient_reduction(model[1], "sum")
    return model


def forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    hidden = model[1](model[0](inputs))
    hidden = model[2](hidden.to(torch.bfloat16)).float()
    return model[3](hidden).square().mean()


def train(rank: int, world_size: int, optimizer_name: str, overlapped: bool) -> list[torch.Tensor]:
    device_mesh = mesh((world_size,), ("tp",))
    model = small_model()
    optimizer_class = torch.optim.SGD if optimizer_name == "sgd" else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    overlap = ReplicaSyncOverlap([model], device_mesh, bucket_bytes=64) if overlapped else None
    generator = torch.Generator().manual_seed(
        rank
    )  # each rank its own data: gradients differ per rank
    for _ in range(3):
        optimizer.zero_grad()
        for micro in range(2):
            if overlap is not None and micro == 1:
                overlap.last_micro_batch()
            forward(model, torch.randn(4, 6, generator=generator)).backward()
        if overlap is not None:
            overlap.finish()
        else:
            synchronize_tp_replica_gradients([model], device_mesh)
        optimizer.step()
    if overlap is not None:
        overlap.remove()
    return [p.detach().clone() for p in model.parameters()]


def check_parity(rank, world_size, optimizer_name):
    boundary, overlapped = (
        train(rank, world_size, optimizer_name, False),
        train(rank, world_size, optimizer_name, True),
    )
    return [torch.equal(a, b) for a, b in zip(boundary, overlapped, strict=True)], [
        p.sum().item() for p in overlapped
    ]


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_overlap_gives_bitwise_the_same_updates_as_the_boundary_sync(ranks2, optimizer_name):
    results = ranks2.run(check_parity, optimizer_name)
    for same, _ in results:
        assert same == [True] * len(same)
    assert results[0][1] == results[1][1]  # and the replicas stay identical across ranks


def check_missing_gradient(rank, world_size):
    model = small_model()
    overlap = ReplicaSyncOverlap([model], mesh((world_size,), ("tp",)), bucket_bytes=64)
    overlap.last_micro_batch()
    forward(model, torch.ones(2, 6)).backward()
    if rank == 1:
        model[3].bias.grad = None
    before = model[0].weight.grad.clone()
    with pytest.raises(RuntimeError) as error:
        overlap.finish()
    overlap.remove()
    return str(error.value), torch.equal(before, model[0].weight.grad)


def test_overlap_raises_on_every_rank_and_leaves_gradients_untouched(ranks2):
    expected = ("Gradient presence differs across TP replicas: 3.bias", True)
    assert ranks2.run(check_missing_gradient, timeout_s=20) == [expected] * 2
