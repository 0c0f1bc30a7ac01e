import pytest

from tests.harness import RankPool


@pytest.fixture(scope="module")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()
