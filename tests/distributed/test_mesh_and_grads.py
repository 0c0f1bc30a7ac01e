"""The device mesh layout, DTensor gradient finalisation, and a grad norm that counts each replica
once."""

import math
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients, grad_norm
from components.distributed.layout import resolve_parallel_dims
from tests.distributed.common import Holder, recorded_collectives
from tests.harness import mesh


def check_mesh_layout(rank, world_size, tp, ep):
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    meshes = dims.build_meshes("cpu")
    device_mesh, moe = meshes.world, meshes.experts
    return (
        device_mesh.mesh.tolist(),
        device_mesh["dp"].mesh.tolist(),
        device_mesh["tp"].mesh.tolist(),
        moe.mesh.tolist(),
    )


def test_tp_is_innermost_and_ep_folds_adjacent_ranks(ranks4):
    full, dp, tp, moe = ranks4.run(check_mesh_layout, 2, 2)[1]
    assert (full, dp, tp, moe) == ([[0, 1], [2, 3]], [1, 3], [0, 1], [[0, 1], [2, 3]])
    full, dp, tp, moe = ranks4.run(check_mesh_layout, 4, 2)[2]
    assert (full, dp, tp, moe) == ([[0, 1, 2, 3]], [2], [0, 1, 2, 3], [[0, 1], [2, 3]])


def check_mesh_timeouts(rank, world_size):
    dims = resolve_parallel_dims(world_size, tp=2, ep=2)
    meshes = dims.build_meshes("cpu", timedelta(seconds=123))
    device_mesh, moe = meshes.world, meshes.experts
    backend = torch.device("cpu")
    return [
        mesh.get_group(dim)._get_backend(backend).options._timeout.total_seconds()
        for mesh in (device_mesh, moe)
        for dim in range(mesh.ndim)
    ]


def test_every_mesh_group_times_out_when_the_run_says(ranks4):
    # torch makes a mesh's groups with gloo's 30-minute default, not the world's timeout
    assert ranks4.run(check_mesh_timeouts) == [[123.0] * 4] * 4


def check_finalize(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    model = nn.Module()
    for name in ("a", "b"):
        holder = Holder(distribute_tensor(torch.zeros(3), tp, [Replicate()]))
        holder.weight.grad = DTensor.from_local(torch.full((3,), float(rank + 1)), tp, [Partial()])
        setattr(model, name, holder)
    model.sharded = Holder(distribute_tensor(torch.zeros(4), tp, [Shard(0)]))
    model.sharded.weight.grad = DTensor.from_local(torch.full((2,), float(rank)), tp, [Shard(0)])
    model.wrong = Holder(distribute_tensor(torch.zeros(4), tp, [Shard(0)]))
    model.wrong.weight.grad = distribute_tensor(torch.arange(4.0), tp, [Replicate()])
    with recorded_collectives() as calls:
        changed = finalize_dtensor_gradients([model])
    return (
        changed,
        [name for name, _, _ in calls],
        {
            n: (
                getattr(model, n).weight.grad.placements,
                getattr(model, n).weight.grad.to_local().tolist(),
            )
            for n in "ab"
        },
        model.sharded.weight.grad.to_local().tolist(),
        model.wrong.weight.grad.placements,
        model.wrong.weight.grad.to_local().tolist(),
    )


def test_partial_gradients_become_replicate_in_one_flat_all_reduce(ranks2):
    for rank, (changed, calls, replicas, sharded, wrong_placements, wrong) in enumerate(
        ranks2.run(check_finalize)
    ):
        assert changed == 3
        # one presence check of the Replicate parameters, then a and b in one buffer; Shard is a
        # local slice
        assert calls == ["all_reduce", "all_reduce"]
        assert replicas == {n: ((Replicate(),), [3.0] * 3) for n in "ab"}
        assert sharded == [float(rank)] * 2
        assert (wrong_placements, wrong) == ((Shard(0),), [2.0 * rank, 2.0 * rank + 1])


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "plain": (3,),
        "tp_rep": (4,),
        "tp_row": (4, 2),
        "tp_col": (2, 4),
        "dp": (4, 3),
        "grid": (4, 4),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def check_grad_norm(rank, world_size, norm_type):
    grid = mesh((2, 2), ("dp", "tp"))
    full = full_tensors()
    layouts = {
        "tp_rep": (grid["tp"], [Replicate()]),
        "tp_row": (grid["tp"], [Shard(0)]),
        "tp_col": (grid["tp"], [Shard(1)]),
        "dp": (grid["dp"], [Shard(0)]),  # FSDP-sharded norm: a copy on each tp coordinate
        "grid": (grid, [Shard(0), Shard(1)]),
    }
    model = nn.Module()
    model.plain = Holder(torch.zeros(3))
    model.plain.weight.grad = full["plain"].clone()
    for name, (device_mesh, placements) in layouts.items():
        holder = Holder(distribute_tensor(torch.zeros_like(full[name]), device_mesh, placements))
        holder.weight.grad = distribute_tensor(full[name], device_mesh, placements)
        setattr(model, name, holder)
    reference = torch.linalg.vector_norm(
        torch.cat([t.reshape(-1) for t in full.values()]).double(), norm_type
    )
    return grad_norm([model], norm_type).item(), reference.item()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_grad_norm_counts_each_logical_parameter_once(ranks4, norm_type):
    for norm, reference in ranks4.run(check_grad_norm, norm_type):
        assert norm == pytest.approx(reference, rel=1e-12)


def check_clip(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    model = nn.Module()
    model.plain = Holder(torch.zeros(2))
    model.plain.weight.grad = torch.tensor([3.0, 0.0])
    model.sharded = Holder(distribute_tensor(torch.zeros(2), tp, [Shard(0)]))
    model.sharded.weight.grad = distribute_tensor(torch.tensor([0.0, 4.0]), tp, [Shard(0)])
    before = clip_grad_norm_([model], max_norm=1.0).item()
    return before, grad_norm([model]).item(), model.plain.weight.grad.tolist()


def test_clip_scales_every_gradient_to_the_max_norm(ranks2):
    for before, after, plain in ranks2.run(check_clip):
        assert before == pytest.approx(5.0, rel=1e-12)
        assert after == pytest.approx(1.0, rel=1e-5)
        assert plain == pytest.approx([0.6, 0.0], rel=1e-5)


def check_partial_norm_is_refused(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    holder = Holder(distribute_tensor(torch.zeros(2), tp, [Replicate()]))
    holder.weight.grad = DTensor.from_local(torch.ones(2), tp, [Partial()])
    with pytest.raises(ValueError, match="call finalize_dtensor_gradients first"):
        grad_norm([holder])


def test_grad_norm_refuses_unfinalised_partial_gradients(ranks2):
    ranks2.run(check_partial_norm_is_refused)


def check_partial_gradient_missing_on_one_rank(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    model = nn.Module()
    for name in ("norm", "q_norm"):
        holder = Holder(distribute_tensor(torch.zeros(3), tp, [Replicate()]))
        holder.weight.grad = DTensor.from_local(torch.ones(3), tp, [Partial()])
        setattr(model, name, holder)
    if rank == 1:
        model.q_norm.weight.grad = None  # unused by this rank's forward
    with pytest.raises(RuntimeError) as error:
        finalize_dtensor_gradients([model])
    return str(error.value), model.norm.weight.grad.placements


def test_partial_gradient_missing_on_one_rank_raises_on_every_rank_with_its_name(ranks2):
    expected = ("Gradient presence differs across ranks: q_norm.weight", (Partial(),))
    assert ranks2.run(check_partial_gradient_missing_on_one_rank, timeout_s=20) == [expected] * 2
