"""tp_replicas on real gloo ranks: what is reduced, how, over which ranks, and what is left alone.

Each ``check_*`` runs on every rank of a shared pool (see tests/harness.py) and returns what the
test asserts on. Values are small integers or dyadic fractions, so equality is exact.
"""

import gc
import types
import weakref
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from components.distributed import tp_replicas
from components.distributed.tp_replicas import (
    _MODEL_OWNED_GRAD_DIVISOR_ATTR,
    _is_tp_replicated,
    broadcast_tp_replicas,
    exclude_from_tp_replica_sync,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)
from tests.distributed.common import Holder, recorded_collectives
from tests.harness import mesh


def holder_with_grad(grad_value: float, size: int = 4, reduction: str | None = None) -> Holder:
    holder = Holder(torch.zeros(size))
    holder.weight.grad = torch.full((size,), float(grad_value))
    if reduction is not None:
        mark_tp_replica_gradient_reduction(holder, reduction)
    return holder


def tp_ranks(device_mesh) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(device_mesh["tp"].get_group()))


# --- mean and sum --------------------------------------------------------------------------------


def check_mean_and_sum(rank, world_size, values):
    model = nn.Module()
    model.norm = holder_with_grad(values[rank])
    model.q_norm = holder_with_grad(values[rank], reduction="sum")
    count = synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    return count, model.norm.weight.grad.tolist(), model.q_norm.weight.grad.tolist()


def test_mean_averages_and_sum_adds_exactly(ranks2):
    for count, mean, total in ranks2.run(check_mean_and_sum, [1.0, 3.0]):
        assert (count, mean, total) == (2, [2.0] * 4, [4.0] * 4)


def test_mean_and_sum_on_four_tp_ranks(ranks4):
    for count, mean, total in ranks4.run(check_mean_and_sum, [1.0, 3.0, 5.0, 7.0]):
        assert (count, mean, total) == (2, [4.0] * 4, [16.0] * 4)


def check_dp_tp_grid(rank, world_size):
    model = nn.Module()
    model.norm = holder_with_grad(2**rank)
    model.q_norm = holder_with_grad(2**rank, reduction="sum")
    synchronize_tp_replica_gradients([model], mesh((2, 2), ("dp", "tp")))
    return model.norm.weight.grad[0].item(), model.q_norm.weight.grad[0].item()


def test_only_the_tp_group_reduces_on_a_dp_by_tp_grid(ranks4):
    # TP groups are {0, 1} and {2, 3}; a reduction over all ranks would give 15 (or 3.75).
    assert ranks4.run(check_dp_tp_grid) == [(1.5, 3.0), (1.5, 3.0), (6.0, 12.0), (6.0, 12.0)]


# --- order ---------------------------------------------------------------------------------------

SIZES = {"a": 3, "b": 5, "c": 7}


def check_registration_order_reversed_on_rank_one(rank, world_size):
    model = nn.Module()
    for name in sorted(SIZES, reverse=rank == 1):
        holder = holder_with_grad(
            10 * rank + SIZES[name], size=SIZES[name], reduction="sum" if name == "b" else None
        )
        holder.weight.data.fill_(100 * rank + SIZES[name])
        holder.register_buffer("stat", torch.full((SIZES[name],), float(rank)))
        setattr(model, name, holder)
    device_mesh = mesh((world_size,), ("tp",))
    broadcast = broadcast_tp_replicas([model], device_mesh)
    synced = synchronize_tp_replica_gradients([model], device_mesh)
    weights = {name: getattr(model, name).weight.tolist() for name in SIZES}
    grads = {name: getattr(model, name).weight.grad.tolist() for name in SIZES}
    stats = {name: getattr(model, name).stat.tolist() for name in SIZES}
    return broadcast, synced, weights, grads, stats


def test_registration_order_does_not_change_the_result(ranks2):
    expected_grads = {
        "a": [8.0] * 3,
        "b": [20.0] * 5,
        "c": [12.0] * 7,
    }  # mean(3,13), sum(5,15), mean(7,17)
    expected_weights = {name: [float(size)] * size for name, size in SIZES.items()}
    for broadcast, synced, weights, grads, stats in ranks2.run(
        check_registration_order_reversed_on_rank_one
    ):
        assert (broadcast, synced) == (6, 3)
        assert grads == expected_grads
        assert weights == expected_weights
        assert stats == {name: [0.0] * size for name, size in SIZES.items()}


# --- what is left alone --------------------------------------------------------------------------


def check_non_replicas_untouched(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    value = float(rank + 1)
    model = nn.Module()
    model.norm = holder_with_grad(value)  # the one genuine replica
    model.experts = nn.Module()
    model.experts.inner = holder_with_grad(value)
    model.experts.register_buffer("counts", torch.full((2,), value))
    exclude_from_tp_replica_sync(model.experts)
    model.owned = holder_with_grad(value)
    setattr(model.owned.weight, _MODEL_OWNED_GRAD_DIVISOR_ATTR, 2)
    model.sharded = Holder(DTensor.from_local(torch.full((2,), value), tp, [Shard(0)]))
    model.sharded.weight.grad = DTensor.from_local(torch.full((2,), value), tp, [Shard(0)])
    model.partial = Holder(distribute_tensor(torch.zeros(3), tp, [Replicate()]))
    model.partial.weight.grad = DTensor.from_local(torch.full((3,), value), tp, [Partial()])

    synced = synchronize_tp_replica_gradients([model], tp)
    broadcast = broadcast_tp_replicas([model], tp)
    partial_grad = model.partial.weight.grad
    return {
        "synced": synced,
        "broadcast": broadcast,
        "norm": model.norm.weight.grad[0].item(),
        "expert": model.experts.inner.weight.grad[0].item(),
        "expert_weight": model.experts.inner.weight[0].item(),
        "expert_buffer": model.experts.counts[0].item(),
        "owned": model.owned.weight.grad[0].item(),
        "sharded": model.sharded.weight.grad.to_local()[0].item(),
        "sharded_weight": model.sharded.weight.to_local()[0].item(),
        "partial": partial_grad.to_local()[0].item(),
        "partial_placements": partial_grad.placements,
    }


def test_excluded_owned_sharded_and_partial_are_untouched(ranks2):
    for rank, result in enumerate(ranks2.run(check_non_replicas_untouched)):
        value = float(rank + 1)
        assert result["synced"] == 1 and result["norm"] == 1.5
        # broadcast: the norm and the Replicate parameter behind the partial gradient; nothing else
        assert result["broadcast"] == 2
        for key in (
            "expert",
            "expert_weight",
            "expert_buffer",
            "owned",
            "sharded",
            "sharded_weight",
            "partial",
        ):
            assert result[key] == (0.0 if key == "expert_weight" else value), key
        assert result["partial_placements"] == (Partial(),)


def check_dtensor_on_dp_submesh(rank, world_size):
    grid = mesh((2, 2), ("dp", "tp"))
    dp = grid["dp"]  # FSDP-style: sharded over dp, physically copied on each tp coordinate
    holder = Holder(distribute_tensor(torch.zeros(4, 2), dp, [Shard(0)]))
    holder.weight.grad = DTensor.from_local(torch.full((2, 2), float(2**rank)), dp, [Shard(0)])
    synced = synchronize_tp_replica_gradients([holder], grid)
    grad = holder.weight.grad
    return synced, grad.to_local().tolist(), tuple(grad.shape), grad.placements


def test_dtensor_on_a_dp_only_submesh_is_reduced_over_tp(ranks4):
    for rank, (synced, local, shape, placements) in enumerate(
        ranks4.run(check_dtensor_on_dp_submesh)
    ):
        expected = 1.5 if rank < 2 else 6.0
        assert (synced, local, shape, placements) == (1, [[expected] * 2] * 2, (4, 2), (Shard(0),))


def check_expert_on_folded_mesh(rank, world_size):
    folded = mesh((2, 2), ("ep_shard", "ep"))  # the TP peers {0,1} differ along ep
    model = nn.Module()
    model.router = holder_with_grad(2**rank)
    model.expert = Holder(DTensor.from_local(torch.zeros(1, 3), folded, [Replicate(), Shard(0)]))
    model.expert.weight.grad = DTensor.from_local(
        torch.full((1, 3), float(2**rank)), folded, [Replicate(), Shard(0)]
    )
    synced = synchronize_tp_replica_gradients([model], mesh((2, 2), ("dp", "tp")))
    return (
        synced,
        model.router.weight.grad[0].item(),
        model.expert.weight.grad.to_local()[0, 0].item(),
    )


def test_expert_dtensor_on_folded_ep_mesh_is_not_a_replica(ranks4):
    expected = [(1, 1.5, 1.0), (1, 1.5, 2.0), (1, 6.0, 4.0), (1, 6.0, 8.0)]
    assert ranks4.run(check_expert_on_folded_mesh) == expected


# --- replica detection ---------------------------------------------------------------------------


def check_is_tp_replicated(rank, world_size):
    grid = mesh((2, 2), ("dp", "tp"))
    peers = tp_ranks(grid)

    def replicated(device_mesh, placements):
        tensor = DTensor.from_local(torch.zeros(2), device_mesh, placements, run_check=False)
        return _is_tp_replicated(tensor, peers, rank, "tp")

    folded = mesh((2, 2), ("ep_shard", "ep"))
    renamed = mesh(
        (2, 2), ("outer", "inner")
    )  # same layout, other names: the answer must not change
    return {
        "plain": _is_tp_replicated(torch.zeros(2), peers, rank, "tp"),
        "tp_replicate": replicated(grid, [Shard(0), Replicate()]),
        "tp_shard": replicated(grid, [Replicate(), Shard(0)]),
        "tp_partial": replicated(grid, [Replicate(), Partial()]),
        "dp_submesh_shard": replicated(grid["dp"], [Shard(0)]),
        "folded_ep_shard": replicated(folded, [Replicate(), Shard(0)]),
        "folded_ep_shard_dim_shard": replicated(folded, [Shard(0), Replicate()]),
        "folded_replicate": replicated(folded, [Replicate(), Replicate()]),
        "renamed_inner_shard": replicated(renamed, [Replicate(), Shard(0)]),
        "renamed_outer_shard": replicated(renamed, [Shard(0), Replicate()]),
        "flat_ep_shard": replicated(mesh((4,), ("ep",)), [Shard(0)]),
        "flat_ep_replicate": replicated(mesh((4,), ("ep",)), [Replicate()]),
    }


def test_replica_detection_by_placement_and_coordinates(ranks4):
    expected = {
        "plain": True,
        "tp_replicate": True,
        "tp_shard": False,
        "tp_partial": False,
        "dp_submesh_shard": True,
        "folded_ep_shard": False,
        "folded_ep_shard_dim_shard": True,
        "folded_replicate": True,
        "renamed_inner_shard": False,
        "renamed_outer_shard": True,
        "flat_ep_shard": False,
        "flat_ep_replicate": True,
    }
    assert ranks4.run(check_is_tp_replicated) == [expected] * 4


# --- precision, chunking, counts -----------------------------------------------------------------


def check_patched_all_reduce(rank, world_size):
    """A bf16 replica synced twice (the plan built, then reused) under a spy on the module's
    ``dist.all_reduce`` that still calls the real one."""
    holder = Holder(torch.tensor([120.0 + rank], dtype=torch.bfloat16))
    device_mesh = mesh((world_size,), ("tp",))
    seen = []
    for _ in range(2):
        holder.weight.grad = torch.tensor([1.0 + rank], dtype=torch.bfloat16)
        with patch(
            "components.distributed.tp_replicas.dist.all_reduce", wraps=dist.all_reduce
        ) as spy:
            synced = synchronize_tp_replica_gradients([holder], device_mesh)
        wire = [call.args[0].dtype for call in spy.call_args_list]
        seen.append((synced, wire, holder.weight.grad.dtype, holder.weight.grad.tolist()))
    return seen


def test_a_spy_on_the_modules_dist_all_reduce_sees_the_two_all_reduces(ranks2):
    once = (1, [torch.int32, torch.float32], torch.bfloat16, [1.5])
    assert ranks2.run(check_patched_all_reduce) == [[once, once]] * 2


def check_module_dist_replaced(rank, world_size):
    """``tp_replicas.dist`` itself replaced by a namespace whose collectives record and forward:
    every collective of both functions goes through the name at call time."""
    calls = []

    def recording(name):
        def call(tensor, *args, **kwargs):
            calls.append((name, tensor.dtype, tensor.numel()))
            return getattr(dist, name)(tensor, *args, **kwargs)

        return call

    spy = types.SimpleNamespace(**{name: getattr(dist, name) for name in dir(dist)})
    spy.all_reduce, spy.broadcast = recording("all_reduce"), recording("broadcast")
    model = nn.Module()
    model.norm = holder_with_grad(rank + 1, size=3)
    model.low = Holder(torch.zeros(2, dtype=torch.bfloat16))
    model.low.weight.grad = torch.full((2,), float(rank + 1), dtype=torch.bfloat16)
    device_mesh = mesh((world_size,), ("tp",))
    with patch.object(tp_replicas, "dist", spy):
        counts = [broadcast_tp_replicas([model], device_mesh)]
        counts += [synchronize_tp_replica_gradients([model], device_mesh) for _ in range(2)]
    return counts, calls


def test_every_collective_goes_through_the_modules_dist_name(ranks2):
    sync = [("all_reduce", torch.int32, 6), ("all_reduce", torch.float32, 2)]
    sync += [("all_reduce", torch.float32, 3)]
    broadcast = [("broadcast", torch.bfloat16, 2), ("broadcast", torch.float32, 3)]
    for counts, calls in ranks2.run(check_module_dist_replaced):
        assert counts == [2, 2, 2]
        assert calls == broadcast + sync + sync


def check_low_precision(rank, world_size):
    model = nn.Module()
    model.bf16 = Holder(torch.zeros(4, dtype=torch.bfloat16))
    model.bf16.weight.grad = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
    model.fp16 = Holder(torch.zeros(4, dtype=torch.float16))
    model.fp16.weight.grad = torch.full((4,), float(rank + 1), dtype=torch.float16)
    mark_tp_replica_gradient_reduction(model.fp16, "sum")
    with recorded_collectives() as calls:
        synced = synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    bf16, fp16 = model.bf16.weight.grad, model.fp16.weight.grad
    return synced, calls, (bf16.dtype, bf16.tolist()), (fp16.dtype, fp16.tolist())


def test_low_precision_gradients_travel_as_fp32_and_come_back_in_their_dtype(ranks2):
    for synced, calls, bf16, fp16 in ranks2.run(check_low_precision):
        assert synced == 2
        # one int32 pre-check, then one FP32 buffer per (reduction, dtype) group
        assert calls == [
            ("all_reduce", torch.int32, 6),
            ("all_reduce", torch.float32, 4),
            ("all_reduce", torch.float32, 4),
        ]
        assert bf16 == (torch.bfloat16, [1.5] * 4)
        assert fp16 == (torch.float16, [3.0] * 4)


def check_chunking(rank, world_size, limit_bytes):
    model = nn.Module()
    for name, size in SIZES.items():
        setattr(model, name, holder_with_grad(rank + 1, size=size))
    original = tp_replicas._MAX_FLAT_BUFFER_BYTES
    tp_replicas._MAX_FLAT_BUFFER_BYTES = limit_bytes
    try:
        with recorded_collectives() as calls:
            synced = synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    finally:
        tp_replicas._MAX_FLAT_BUFFER_BYTES = original
    return (
        synced,
        [numel for _, _, numel in calls],
        {n: getattr(model, n).weight.grad.tolist() for n in SIZES},
    )


def test_gradients_travel_in_one_flat_buffer_when_they_fit(ranks2):
    for synced, sizes, grads in ranks2.run(check_chunking, 256 * 1024 * 1024):
        assert (synced, sizes) == (3, [9, 15])
        assert grads == {name: [1.5] * size for name, size in SIZES.items()}


def test_small_limit_cuts_buffers_and_every_gradient_is_reduced_once(ranks2):
    # The pre-check carries 3 flags per candidate (9). 32 bytes: a (12 B) + b (20 B) fit together; c
    # (28 B) comes alone.
    for synced, sizes, grads in ranks2.run(check_chunking, 32):
        assert (synced, sizes) == (3, [9, 8, 7])
        assert grads == {name: [1.5] * size for name, size in SIZES.items()}


def check_tied_parameter(rank, world_size, reduction):
    model = nn.Module()
    model.embed = holder_with_grad(2 * rank + 1, reduction=reduction)
    model.head = Holder(torch.zeros(1))
    model.head.weight = model.embed.weight
    mark_tp_replica_gradient_reduction(model.head, reduction)
    device_mesh = mesh((world_size,), ("tp",))
    synced = synchronize_tp_replica_gradients([model], device_mesh)
    return synced, broadcast_tp_replicas([model], device_mesh), model.head.weight.grad[0].item()


def test_tied_parameter_is_visited_once(ranks2):
    assert ranks2.run(check_tied_parameter, "sum") == [(1, 1, 4.0)] * 2
    assert ranks2.run(check_tied_parameter, "mean") == [(1, 1, 2.0)] * 2


# --- errors on every rank together ---------------------------------------------------------------


def check_gradient_on_one_rank_only(rank, world_size):
    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    model.b = holder_with_grad(rank + 1)
    if rank == 1:
        model.b.weight.grad = None
    with pytest.raises(RuntimeError, match="Gradient presence differs across TP replicas") as error:
        synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    return str(error.value), model.a.weight.grad[0].item()


def test_gradient_present_on_one_rank_raises_on_every_rank(ranks2):
    results = ranks2.run(check_gradient_on_one_rank_only, timeout_s=20)
    for rank, (message, untouched) in enumerate(results):
        assert message == "Gradient presence differs across TP replicas: b.weight"
        assert untouched == rank + 1  # raised before any data moved


def check_grad_placements_differ(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    holder = Holder(distribute_tensor(torch.zeros(2), tp, [Replicate()]))
    holder.weight.grad = DTensor.from_local(
        torch.ones(2), tp, [Replicate() if rank == 0 else Partial()]
    )
    with pytest.raises(RuntimeError) as error:
        synchronize_tp_replica_gradients([holder], tp)
    return str(error.value)


def test_gradient_placements_that_differ_raise_on_every_rank(ranks2):
    expected = "Gradient placements differ across TP replicas: weight"
    assert ranks2.run(check_grad_placements_differ, timeout_s=20) == [expected] * 2


def check_sparse_gradient(rank, world_size, sparse_ranks):
    model = nn.Module()
    model.embedding = nn.Embedding(4, 2, sparse=rank in sparse_ranks)
    model.embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError) as error:
        synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    return str(error.value)


def test_sparse_gradient_raises_on_every_rank(ranks2):
    expected = (
        "Sparse gradients cannot be flattened for TP replica synchronization: embedding.weight"
    )
    assert ranks2.run(check_sparse_gradient, (0, 1), timeout_s=20) == [expected] * 2
    assert ranks2.run(check_sparse_gradient, (1,), timeout_s=20) == [expected] * 2


# --- broadcast -----------------------------------------------------------------------------------


def check_broadcast(rank, world_size):
    tp = mesh((world_size,), ("tp",))
    value = float(10 + rank)
    model = nn.Module()
    model.norm = Holder(torch.full((3,), value))
    model.frozen = Holder(torch.full((3,), value), requires_grad=False)
    model.unused = Holder(torch.full((2,), value))
    model.register_buffer("rope", torch.full((2,), value))
    model.meta = Holder(torch.empty(3, device="meta"))
    model.empty = Holder(torch.empty(0))
    model.sharded = Holder(DTensor.from_local(torch.full((2,), value), tp, [Shard(0)]))
    model.replicate = Holder(
        DTensor.from_local(torch.full((2,), value), tp, [Replicate()], run_check=False)
    )
    broadcast = broadcast_tp_replicas([model], tp)
    return broadcast, {
        "norm": model.norm.weight.tolist(),
        "frozen": model.frozen.weight.tolist(),
        "frozen_requires_grad": model.frozen.weight.requires_grad,
        "unused": model.unused.weight.tolist(),
        "rope": model.rope.tolist(),
        "meta": model.meta.weight.is_meta,
        "sharded": model.sharded.weight.to_local().tolist(),
        "replicate": model.replicate.weight.to_local().tolist(),
    }


def test_broadcast_copies_every_replica_from_tp_rank_zero(ranks2):
    for rank, (count, values) in enumerate(ranks2.run(check_broadcast)):
        assert (
            count == 5
        )  # norm, frozen, unused, replicate DTensor, rope buffer; not meta, empty or sharded
        assert values == {
            "norm": [10.0] * 3,
            "frozen": [10.0] * 3,
            "frozen_requires_grad": False,
            "unused": [10.0] * 2,
            "rope": [10.0] * 2,
            "meta": True,
            "sharded": [10.0 + rank] * 2,
            "replicate": [10.0] * 2,
        }


def check_broadcast_on_grid(rank, world_size):
    holder = Holder(torch.full((2,), float(2**rank)))
    count = broadcast_tp_replicas([holder], mesh((2, 2), ("dp", "tp")))
    return count, holder.weight[0].item()


def test_broadcast_source_is_the_first_rank_of_each_tp_group(ranks4):
    assert ranks4.run(check_broadcast_on_grid) == [(1, 1.0), (1, 1.0), (1, 4.0), (1, 4.0)]


def check_no_tp_means_no_collective(rank, world_size):
    model = nn.Module()
    model.norm = holder_with_grad(rank + 1)
    meshes = [None, mesh((world_size,), ("dp",)), mesh((world_size, 1), ("dp", "tp"))]
    with recorded_collectives() as calls:
        counts = [
            (synchronize_tp_replica_gradients([model], m), broadcast_tp_replicas([model], m))
            for m in meshes
        ]
    return counts, calls, model.norm.weight.grad[0].item()


def test_without_a_tp_axis_of_size_above_one_both_return_zero(ranks2):
    for rank, (counts, calls, grad) in enumerate(ranks2.run(check_no_tp_means_no_collective)):
        assert counts == [(0, 0)] * 3
        assert calls == []
        assert grad == rank + 1


# --- the plan and its persistent buffers, kept with the model between calls -----------------------


def syncer(model, device_mesh):
    """The free function, called as the recipe calls it: once per step on the same model."""
    return lambda: synchronize_tp_replica_gradients([model], device_mesh)


def check_plan_rebuilt_after_changes(rank, world_size):
    device_mesh = mesh((world_size,), ("tp",))
    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    sync = syncer(model, device_mesh)
    results = [sync()]
    model.a.weight = nn.Parameter(torch.zeros(2))  # a parameter replaced (new shape, new object)
    model.a.weight.grad = torch.full((2,), float(4 * rank + 1))
    results.append((sync(), model.a.weight.grad.tolist()))
    model.a._parameters["weight"] = nn.Parameter(
        torch.zeros(3)
    )  # behind __setattr__'s back, as FSDP2 does
    model.a.weight.grad = torch.full((3,), float(2 * rank))
    results.append((sync(), model.a.weight.grad.tolist()))
    model.b = holder_with_grad(2 * rank + 3)  # a module added
    model.b.inner = holder_with_grad(rank, size=1)  # and one added below it
    results.append((sync(), model.b.inner.weight.grad.tolist()))
    mark_tp_replica_gradient_reduction(model.b, "sum")  # a marker changed
    model.b.weight.grad = torch.full((4,), float(rank + 1))
    results.append((sync(), model.b.weight.grad.tolist()))
    del model.b  # a module removed: its parameters must no longer be reduced
    model.a.weight.requires_grad_(False)  # and a parameter frozen
    model.c = holder_with_grad(rank)
    with recorded_collectives() as calls:
        results.append(sync())
    return results, calls


def test_plan_is_rebuilt_when_parameters_modules_or_markers_change(ranks2):
    for results, calls in ranks2.run(check_plan_rebuilt_after_changes):
        assert results == [1, (1, [3.0] * 2), (1, [1.0] * 3), (3, [0.5]), (3, [3.0] * 4), 1]
        assert calls == [("all_reduce", torch.int32, 3), ("all_reduce", torch.float32, 4)]


def check_each_change_alone_rebuilds_the_plan(rank, world_size):
    device_mesh = mesh((world_size,), ("tp",))
    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    model.b = holder_with_grad(rank + 1)
    model.frozen = holder_with_grad(rank + 1)
    model.frozen.weight.requires_grad_(False)
    sync = syncer(model, device_mesh)
    counts = [sync()]
    bucket = model.a.weight.grad._base  # the plan's persistent bucket
    nn.Linear(2, 2)  # built elsewhere: the plan and its bucket are kept
    counts.append(sync())
    kept = model.a.weight.grad._base is bucket
    model.frozen.weight.requires_grad_(True)  # thawed, nothing else changed: reduced from now on
    model.frozen.weight.grad = torch.full((4,), float(rank))
    counts.append(sync())
    del model.b  # deleted, nothing registered: no longer reduced
    counts.append(sync())
    model.a.weight.grad = torch.full((4,), float(rank))  # fresh beside a kept bucket view
    counts.append(sync())
    mixed = (model.a.weight.grad.tolist(), model.frozen.weight.grad.tolist())
    model.a.weight.requires_grad_(False)  # frozen, nothing else changed: left alone
    model.a.weight.grad = torch.full((4,), float(rank))
    counts.append(sync())
    return counts, kept, mixed, model.a.weight.grad.tolist() == [float(rank)] * 4


def test_each_change_alone_rebuilds_the_plan_and_an_unrelated_module_does_not(ranks2):
    for counts, kept, mixed, frozen_untouched in ranks2.run(
        check_each_change_alone_rebuilds_the_plan
    ):
        assert counts == [2, 2, 3, 2, 2, 1] and kept
        assert mixed == ([0.5] * 4, [0.5] * 4)
        assert frozen_untouched  # each rank's own gradient, not reduced


def check_gradients_become_bucket_views(rank, world_size):
    device_mesh = mesh((world_size,), ("tp",))
    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    model.b = holder_with_grad(rank + 1, size=3, reduction="sum")
    model.low = Holder(torch.zeros(2, dtype=torch.bfloat16))
    model.low.weight.grad = torch.full((2,), float(rank + 1), dtype=torch.bfloat16)
    sync = syncer(model, device_mesh)  # once per step on the same model, as the recipe calls it
    sync()
    first = [model.a.weight.grad, model.b.weight.grad]
    # accumulate the next step in place, as autograd does into an existing .grad, then sync again
    loss = (
        (model.a.weight * (rank + 1)).sum()
        + (model.b.weight * (rank + 1)).sum()
        + model.low.weight.sum().float()
    )
    model.low.weight.grad = None
    loss.backward()
    with recorded_collectives() as calls:
        sync()
    same_objects = [g is p.weight.grad for g, p in zip(first, (model.a, model.b), strict=True)]
    grads = [
        model.a.weight.grad.tolist(),
        model.b.weight.grad.tolist(),
        model.low.weight.grad.tolist(),
    ]
    model.a.weight.grad = (
        None  # set_to_none, as optimizer.zero_grad does: fresh tensors are packed again
    )
    model.b.weight.grad = torch.full((3,), float(rank))
    model.a.weight.grad = torch.full((4,), float(rank))
    sync()
    return same_objects, grads, calls, model.a.weight.grad.tolist(), model.b.weight.grad.tolist()


def test_fp32_gradients_are_reduced_in_place_as_views_of_a_persistent_bucket(ranks2):
    for same_objects, grads, calls, fresh_mean, fresh_sum in ranks2.run(
        check_gradients_become_bucket_views
    ):
        assert same_objects == [True, True]  # autograd accumulated into the bucket views
        # a: mean(1.5 + 1, 1.5 + 2) = 3.0; b: sum(3 + 1, 3 + 2) = 9.0; low: mean(1, 1) = 1.0
        assert grads == [[3.0] * 4, [9.0] * 3, [1.0] * 2]
        assert calls == [("all_reduce", torch.int32, 9), ("all_reduce", torch.float32, 4)] + [
            ("all_reduce", torch.float32, n) for n in (3, 2)
        ]
        assert (fresh_mean, fresh_sum) == ([0.5] * 4, [1.0] * 3)


def check_buffers_freed_with_the_model(rank, world_size):
    import gc
    import weakref

    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    bucket = weakref.ref(model.a.weight.grad._base)
    alive_before = bucket() is not None
    del model
    gc.collect()
    return alive_before, bucket() is None


def test_persistent_buffers_go_away_with_the_model(ranks2):
    assert ranks2.run(check_buffers_freed_with_the_model) == [(True, True)] * 2


def check_model_is_freed_after_a_sync(rank, world_size):
    model = nn.Module()
    model.a = holder_with_grad(rank + 1)
    model.register_forward_pre_hook(
        lambda module, args, root=model: None
    )  # references its root, as FSDP2's do
    synced = synchronize_tp_replica_gradients([model], mesh((world_size,), ("tp",)))
    gone = weakref.ref(model)
    del model
    gc.collect()
    return synced, gone() is None


def test_the_cached_plan_and_buffers_go_with_the_model(ranks2):
    assert ranks2.run(check_model_is_freed_after_a_sync) == [(1, True)] * 2


def check_gradients_given_other_storage(rank, world_size):
    # after a first sync the gradients are the bucket's slices; then each is changed a different way
    device_mesh = mesh((world_size,), ("tp",))
    model = nn.Module()
    for name in ("a", "b", "c"):
        setattr(model, name, holder_with_grad(rank + 1))
    sync = syncer(model, device_mesh)
    sync()
    model.a.weight.grad.data = torch.full((4,), float(rank + 10))  # other storage, same object
    model.b.weight.grad, model.c.weight.grad = (
        model.c.weight.grad,
        model.b.weight.grad,
    )  # slices swapped
    model.b.weight.grad.fill_(rank + 20)
    model.c.weight.grad.fill_(rank + 30)
    sync()
    after_changes = [getattr(model, n).weight.grad.tolist() for n in ("a", "b", "c")]
    owned = torch.full((8,), float(rank))  # gradients that are slices of the caller's own buffer
    model.a.weight.grad, model.b.weight.grad = owned[:4], owned[4:]
    held = model.c.weight.grad = torch.full((4,), float(rank + 40))
    sync()
    aliases = [
        model.a.weight.grad.data_ptr() == owned.data_ptr(),
        model.b.weight.grad._base is owned,
    ]
    model.double()  # a cast gives every gradient float64 storage: the plan's buffers follow
    for name in ("a", "b", "c"):
        getattr(model, name).weight.grad.fill_(rank + 0.25)
    sync()
    cast = [
        (getattr(model, n).weight.grad.dtype, getattr(model, n).weight.grad.tolist())
        for n in ("a", "b", "c")
    ]
    return after_changes, owned.tolist(), held.tolist(), aliases, cast


def test_gradients_given_other_storage_swapped_or_owned_by_the_caller_are_reduced(ranks2):
    results = ranks2.run(check_gradients_given_other_storage)
    for after_changes, owned, held, aliases, cast in results:
        assert after_changes == [[10.5] * 4, [20.5] * 4, [30.5] * 4]
        assert (
            owned == [0.5] * 8 and held == [40.5] * 4
        )  # every gradient handed in holds the result, in place
        assert aliases == [True, True]  # slices of the caller's buffer stay its slices
        assert cast == [(torch.float64, [0.75] * 4)] * 3
