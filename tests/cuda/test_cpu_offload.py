"""The cuda lane's ``train.cpu_offload=true`` (``pytest -m cuda``, run by ``bench/gpu_check.sh``):
FSDP2's ``CPUOffloadPolicy`` on one GPU (FSDP's one-rank shard) follows the run without it, and the
device memory it frees is the parameters', gradients' and optimizer state's. On the CPU a run with
the key equals the run without it exactly (tests/e2e/test_cpu_offload.py); here the optimizer step
runs on the host, whose kernels round differently from the GPU's, hence a band, not equality."""

from pathlib import Path

import pytest
import torch

from tests.cuda.test_single_gpu import recipe, relative_gaps

pytestmark = pytest.mark.cuda
EXACT = ["train.tf32=false"]
# ~0.1 B parameters: fp32 weights, gradients and AdamW moments (~1.6 GiB) dwarf the activations
WIDE = ["model.config.hidden_size=1024", "model.config.intermediate_size=2816"]
WIDE += ["model.config.num_hidden_layers=8", "model.config.head_dim=64"]
WIDE += ["model.config.num_attention_heads=16", "model.config.num_key_value_heads=4"]


@pytest.fixture(autouse=True)
def a_gpu():
    assert torch.cuda.is_available(), "the cuda lane (pytest -m cuda) needs a GPU"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cpu_offload_on_one_gpu_follows_the_run_without_it(tmp_path: Path, optimizer: str):
    kept = recipe(tmp_path / "kept", *EXACT, f"optim={optimizer}")
    offloaded = recipe(
        tmp_path / "offloaded", *EXACT, f"optim={optimizer}", "train.cpu_offload=true"
    )
    assert max(relative_gaps(offloaded, kept)) < 1e-4, (kept, offloaded)


def test_cpu_offload_frees_the_device_memory_of_the_sharded_state(tmp_path: Path):
    kept = recipe(tmp_path / "kept", *EXACT, *WIDE)
    offloaded = recipe(tmp_path / "offloaded", *EXACT, *WIDE, "train.cpu_offload=true")
    peak_kept = max(r["peak_memory_gib"] for r in kept)
    peak_offloaded = max(r["peak_memory_gib"] for r in offloaded)
    assert peak_offloaded < 0.5 * peak_kept, (peak_kept, peak_offloaded)
    assert max(relative_gaps(offloaded, kept)) < 1e-3
