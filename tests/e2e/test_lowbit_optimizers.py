"""A low-bit optimizer through the real command line: ``optim=adamw4bit`` on the tiny Llama at
tp=1 (each matmul weight holds the 4,096 values torchao quantizes from, so the 4-bit moments are
live), checkpointed at step 2 of 4 and resumed from there into another folder, equals the
uninterrupted run exactly: torchao's quantized state tensors go through DCP and come back.

The loss against ``optim=adamw`` over 30 steps at tp=2 dp=2 and the state bytes per rank are
measured by hand and in tests/distributed/test_lowbit_optimizers.py (docs/precision-and-memory.md).
"""

import json
import os
import sys
from pathlib import Path

from tests import cli

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "optim=adamw4bit",
    "train.max_steps=4",
    "train.warmup_steps=1",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


def finetune(output_dir: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, "recipes/finetune.py", *COMMON, *overrides]
    command.append(f"output_dir={output_dir}")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
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
