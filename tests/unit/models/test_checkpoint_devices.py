"""Weights headed for a device (CUDA on a GPU run; the meta device stands in here) are read into a
CPU buffer and copied over: file bytes never go through ``.numpy()`` of a non-CPU tensor."""

import pytest
import torch
from safetensors.torch import save_file

import components.models.checkpoint as checkpoint_module
from components.models.checkpoint import Checkpoint, StoredTensor


@pytest.fixture
def numpy_devices(monkeypatch) -> list[torch.device]:
    """The device of every tensor ``.numpy()`` is called on from now on."""
    seen, numpy = [], torch.Tensor.numpy

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.device)
        return numpy(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", spy)
    return seen


@pytest.fixture
def staged(monkeypatch) -> list[torch.Tensor]:
    """Every host buffer the loader stages a device's tensor in."""
    buffers, host_buffer = [], checkpoint_module.host_buffer

    def spy(like: torch.Tensor) -> torch.Tensor:
        buffers.append(host_buffer(like))
        return buffers[-1]

    monkeypatch.setattr(checkpoint_module, "host_buffer", spy)
    return buffers


def test_a_meta_target_takes_the_copy_path(tmp_path, numpy_devices, staged):
    stored = torch.randn(37, 24, generator=torch.Generator().manual_seed(0))
    save_file({"matrix": stored}, tmp_path / "model.safetensors")
    out = torch.empty(19, 24, device="meta")
    with Checkpoint(tmp_path) as checkpoint:
        assert StoredTensor(key="matrix").read_into(checkpoint, (5, 0), out)
    assert len(staged) == 1 and staged[0].device.type == "cpu"
    assert torch.equal(staged[0], stored[5:24])  # what the copy then puts on the device
    assert numpy_devices and {device.type for device in numpy_devices} == {"cpu"}


def test_a_cpu_target_is_read_in_place(tmp_path, staged):
    stored = torch.arange(12.0).reshape(3, 4)
    save_file({"matrix": stored}, tmp_path / "model.safetensors")
    out = torch.empty(2, 4)
    with Checkpoint(tmp_path) as checkpoint:
        assert StoredTensor(key="matrix").read_into(checkpoint, (1, 0), out)
    assert not staged and torch.equal(out, stored[1:])


def test_file_bytes_are_never_read_into_a_device_tensor(tmp_path):
    save_file({"matrix": torch.zeros(3, 4)}, tmp_path / "model.safetensors")
    with Checkpoint(tmp_path) as checkpoint, pytest.raises(ValueError, match="CPU memory only"):
        checkpoint.read("matrix", (0, 0), (3, 4), out=torch.empty(3, 4, device="meta"))
