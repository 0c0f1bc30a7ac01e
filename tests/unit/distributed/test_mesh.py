"""Mesh sizes: dp inferred, every misfit named with its numbers."""

import pytest

from components.distributed.layout import ParallelDims, resolve_parallel_dims


def test_dp_is_inferred_from_world_size_and_tp():
    assert resolve_parallel_dims(8, tp=2) == ParallelDims(dp_shard=4, tp=2, ep=1)
    assert resolve_parallel_dims(4, tp=4, dp=1, ep=4).ep_shard == 1
    assert resolve_parallel_dims(4, tp=2, ep=2).ep_shard == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "tp": 4}, "world size 6 is not divisible by tp=4"),
        ({"world_size": 4, "tp": 2, "dp": 3}, "dp=3 × tp=2 = 6 does not match the world size 4"),
        ({"world_size": 4, "tp": 2, "ep": 3}, "world size 4 is not divisible by ep=3"),
        ({"world_size": 4, "tp": 0}, "tp must be a positive integer, got 0"),
        ({"world_size": 4, "tp": 2, "dp": -1}, "dp must be a positive integer, got -1"),
    ],
)
def test_sizes_that_do_not_fit_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_parallel_dims(**kwargs)


def test_all_problems_are_reported_at_once():
    with pytest.raises(
        ValueError, match="not divisible by tp=4; world size 6 is not divisible by ep=4"
    ):
        resolve_parallel_dims(6, tp=4, ep=4)


def test_cp_sits_between_dp_and_tp():
    dims = resolve_parallel_dims(8, tp=2, cp=2)
    assert (dims.dp, dims.cp, dims.tp, dims.data_parallel) == (2, 2, 2, 4)
    with pytest.raises(ValueError, match="world size 6 is not divisible by cp=4 × tp=1"):
        resolve_parallel_dims(6, cp=4)
    with pytest.raises(ValueError, match="dp=2 × cp=2 × tp=2 = 8 does not match the world size 4"):
        resolve_parallel_dims(4, tp=2, dp=2, cp=2)
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        resolve_parallel_dims(4, cp=0)


def test_hsdp_splits_dp_into_replicas_of_shards():
    dims = resolve_parallel_dims(8, tp=2, dp_replicate=2)  # dp_shard inferred from the world
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (4, 2, 2)
    dims = resolve_parallel_dims(4, dp_replicate=2, dp_shard=2)
    assert (dims.dp, dims.dp_shard, dims.data_parallel) == (4, 2, 4)
    assert resolve_parallel_dims(4, dp=4, dp_replicate=1).dp_shard == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "dp_replicate": 4}, "dp=6 is not divisible by dp_replicate=4"),
        (
            {"world_size": 4, "dp": 4, "dp_replicate": 2, "dp_shard": 1},
            "dp=4 does not match dp_replicate=2 × dp_shard=1 = 2",
        ),
        ({"world_size": 8, "dp_replicate": 2, "dp_shard": 2}, "dp=4 × tp=1 = 4 does not match"),
        ({"world_size": 8, "cp": 2, "dp_replicate": 2}, "dp_replicate=2 with cp=2 is not supp"),
        ({"world_size": 4, "dp_shard": 0}, "dp_shard must be a positive integer, got 0"),
    ],
)
def test_hsdp_sizes_that_do_not_fit_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_parallel_dims(**kwargs)
