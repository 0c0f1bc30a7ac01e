"""A low-bit optimizer through the real command line: ``optim=adamw4bit`` on the tiny Llama at
tp=1 (each matmul weight holds the 4,096 values torchao quantizes from, so the 4-bit moments are
live), checkpointed at step 2 of 4 and resumed from there into another folder, equals the
uninterrupted run exactly: torchao's quantized state tensors go through DCP and come back.

The loss against ``optim=adamw`` over 30 steps at tp=2 dp=2 and the state bytes per rank are
measured by hand and in tests/distributed/test_lowbit_optimizers.py (docs/precision-and-memory.md).
"""

import json
from pathlib import Path

from tests.e2e.test_trust import run  # its small batches, one command line

LOWBIT = ["optim=adamw4bit", "train.max_steps=4", "checkpoint.export=false"]


def finetune(output_dir: Path, *overrides: str) -> list[dict]:
    result = run(output_dir, *LOWBIT, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_adamw4bit_resumed_mid_run_equals_the_uninterrupted_run(tmp_path):
    whole = finetune(tmp_path / "whole", "checkpoint.every_steps=2")
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed = finetune(tmp_path / "resumed", f"checkpoint.resume={checkpoint}")
    assert [r["step"] for r in resumed] == [3, 4]
    for record, again in zip(whole[2:], resumed, strict=True):
        assert again["loss"] == record["loss"], (record, again)
        assert again["grad_norm"] == record["grad_norm"], (record, again)
