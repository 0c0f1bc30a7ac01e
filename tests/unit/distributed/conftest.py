import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world():
    """This process as rank 5 of a fake world of 8: collectives return at once, move nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    yield
    dist.destroy_process_group()
