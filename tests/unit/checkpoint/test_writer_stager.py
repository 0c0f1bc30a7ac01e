"""An async save stages the state through one stager for the whole run, whose host buffers every
later save refills; every second a save keeps the training thread is handed to the next step's
metrics (``checkpoint_stall_s``)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from components.checkpoint.dcp import load_checkpoint
from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter


@pytest.fixture
def world(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optimizer)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()


def staged_storages(writer: CheckpointWriter) -> dict[int, int]:
    """The stager's host buffers: id of each source storage's buffer -> its data pointer."""
    mapping = writer._stager._state_dict_stager._cached_storage_mapping
    return {id(buffer): buffer.data_ptr() for buffer in mapping.values()}


def test_every_async_save_refills_the_same_host_buffers(tmp_path, world):
    model, optimizer = trained(seed=0)
    keys = dict(keep=2, run_id="run", run_info=None)
    writer = CheckpointWriter(tmp_path / "checkpoints", **keys, asynchronous=True)
    writer.save(TrainState(model=model, optimizer=optimizer, schedule=None, step=1))
    stager, buffers = writer._stager, staged_storages(writer)
    assert len(buffers) >= len(list(model.parameters()))  # weights and Adam's moments
    writer.wait()
    step(model, optimizer)
    writer.save(TrainState(model=model, optimizer=optimizer, schedule=None, step=2))
    assert writer._stager is stager and staged_storages(writer) == buffers
    writer.close()
    assert writer._stager is None and writer.last_path.name.endswith("2")
    restored, restored_optimizer = trained(seed=1)
    load_checkpoint(writer.last_path, restored, restored_optimizer, None)
    for saved, loaded in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(saved, loaded)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_time_a_save_keeps_the_training_thread_is_taken_once(tmp_path, world, asynchronous):
    model, optimizer = trained(seed=0)
    keys = dict(keep=2, run_id="run", run_info=None)
    writer = CheckpointWriter(tmp_path / "checkpoints", **keys, asynchronous=asynchronous)
    assert writer.take_stall() == {}
    writer.save(TrainState(model=model, optimizer=optimizer, schedule=None, step=1))
    writer.wait()
    stall = writer.take_stall()
    assert list(stall) == ["checkpoint_stall_s"] and stall["checkpoint_stall_s"] > 0
    assert writer.take_stall() == {}
    writer.close()
