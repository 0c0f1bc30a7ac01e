"""``recipes/dpo.py`` in the single-GPU lane (``pytest -m cuda``; deselected by default): DPO at
tp=1 on CUDA in fp32 (TF32 off) against the same run on the CPU, full fine-tuning (a frozen
reference on the GPU) and ``peft=lora`` (the reference: the adapters off)."""

import pytest
import torch

from tests.cuda.test_single_gpu import recipe, relative_gaps

pytestmark = pytest.mark.cuda
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8.0", "optim.lr=1e-2"]


@pytest.mark.parametrize("overrides", [[], LORA], ids=["full", "lora"])
def test_dpo_on_the_gpu_matches_the_cpu_run(tmp_path, overrides):
    assert torch.cuda.is_available(), "the cuda lane (pytest -m cuda) needs a GPU"
    fp32 = ["train.tf32=false", *overrides]
    cpu = recipe(tmp_path / "cpu", *fp32, cpu=True, script="dpo.py")
    gpu = recipe(tmp_path / "gpu", *fp32, script="dpo.py")
    assert gpu[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)  # policy = reference
    assert max(relative_gaps(gpu, cpu)) < 1e-3
    assert gpu[-1]["rewards/margins"] == pytest.approx(cpu[-1]["rewards/margins"], abs=1e-3)
