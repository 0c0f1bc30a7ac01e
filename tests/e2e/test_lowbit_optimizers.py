"""Low-bit optimizers through the real command line, checkpointed at step 2 of 4 and resumed from
there into another folder: each equals its uninterrupted run exactly, so torchao's quantized state
tensors go through DCP and come back. ``optim=adamw4bit`` on the tiny Llama at tp=1 (each matmul
weight holds the 4,096 values torchao quantizes from, so the 4-bit moments are live), and
``optim=adamw8bit`` at tp=2 dp=2 on a Llama 128 wide, whose q, o and MLP shards each hold 4,096
values or more: the compiled 8-bit step over parameters sharded by TP and FSDP at once (which failed
while AOT autograd's cache replayed another layout's wrapper: components/training/optimizer.py).

make test runs the 4-bit case; the 8-bit one (109 CPU-s measured: inductor compiles torchao's step
for each shard's shape on four ranks, twice) runs under ``-m sweep``.

The loss against ``optim=adamw`` over 30 steps at tp=2 dp=2 and the state bytes per rank are
measured by hand and in tests/distributed/test_lowbit_optimizers.py (docs/precision-and-memory.md).
"""

import json
from pathlib import Path

import pytest

from tests.e2e.test_trust import run  # its small batches, one command line

STEPS = ["train.max_steps=4", "checkpoint.export=false"]
WIDER = ["model.config.hidden_size=128", "model.config.intermediate_size=256"]
CASES = {
    "adamw4bit_tp1": ["optim=adamw4bit"],
    "adamw8bit_tp2_dp2": ["optim=adamw8bit", "tp=2", "dp=2", *WIDER, "model.config.head_dim=16"],
}


def finetune(output_dir: Path, *overrides: str) -> list[dict]:
    result = run(output_dir, *STEPS, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "case", ["adamw4bit_tp1", pytest.param("adamw8bit_tp2_dp2", marks=pytest.mark.sweep)]
)
def test_a_low_bit_optimizer_resumed_mid_run_equals_the_uninterrupted_run(tmp_path, case):
    whole = finetune(tmp_path / "whole", *CASES[case], "checkpoint.every_steps=2")
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed = finetune(tmp_path / "resumed", *CASES[case], f"checkpoint.resume={checkpoint}")
    assert [r["step"] for r in resumed] == [3, 4]
    for record, again in zip(whole[2:], resumed, strict=True):
        assert again["loss"] == record["loss"], (record, again)
        assert again["grad_norm"] == record["grad_norm"], (record, again)
