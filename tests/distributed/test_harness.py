"""The harness itself: results come back per rank, failures show the rank's traceback, hangs are
killed."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankPool


def all_reduce_rank(rank: int, world_size: int) -> float:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def test_results_come_back_in_rank_order(ranks4):
    assert ranks4.run(all_reduce_rank) == [6.0] * 4


def test_a_failing_rank_fails_the_test_with_its_traceback():
    pool = RankPool(2)
    with pytest.raises(pytest.fail.Exception) as failure:
        pool.run(raise_on_rank_one)
    assert "rank 1 raised" in str(failure.value)
    assert "ValueError: boom on rank one" in str(failure.value)
    assert pool.run(all_reduce_rank) == [1.0, 1.0]  # a fresh pool replaces the killed one
    pool.close()


def test_a_hanging_rank_is_killed_within_the_timeout():
    pool = RankPool(2)  # started within the default timeout: a loaded machine starts slowly
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0\] did not answer within 2 s"):
        pool.run(hang_on_rank_zero, timeout_s=2)
    assert time.monotonic() - start < 15
    pool.close()
