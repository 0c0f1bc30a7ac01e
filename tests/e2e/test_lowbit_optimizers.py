"""Low-bit optimizers through the real command line, checkpointed at step 2 of 4 and resumed from
there into another folder: each equals its uninterrupted run exactly, so torchao's quantized state
tensors go through DCP and come back. ``optim=adamw4bit`` on the tiny Llama at tp=1 (each matmul
weight holds the 4,096 values torchao quantizes from, so the 4-bit moments are live), and
``optim=adamw8bit`` at tp=2 dp=2 on a Llama 128 wide, whose q, o and MLP shards each hold 4,096
values or more: the compiled 8-bit step over parameters sharded by TP and FSDP at once (which failed
while AOT autograd's cache replayed another layout's wrapper: components/training/optimizer.py).

make test runs the 4-bit case; the 8-bit one (109 CPU-s measured: inductor compiles torchao's step
for each shard's shape on four ranks, twice) runs under ``-m sweep``.

Issue 47's loss band over 30 steps at tp=2 dp=2 runs under ``-m sweep`` too (each run compiles
torchao's step on four ranks); the state bytes per rank:
tests/distributed/test_lowbit_optimizers.py.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.e2e.test_trust import REPO, run  # its small batches, one command line

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


BAND = ["model.config.hidden_size=256", "model.config.intermediate_size=512"]
BAND += ["model.config.head_dim=32", "optim.lr=3e-4", "train.max_steps=30", "train.val_every=0"]
BAND += ["checkpoint.export=false"]
TP2_DP2 = ["tp=2", "dp=2"]


def losses(output_dir: Path, *overrides: str) -> list[float]:
    """The per-step loss of a 30-step run at the recipe's own batches (16 rows a step)."""
    command = [sys.executable, "recipes/finetune.py", *BAND, f"output_dir={output_dir}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        [*command, *overrides], cwd=REPO, capture_output=True, text=True, timeout=600,
        env=environment,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def worst_gap(curve: list[float], reference: list[float]) -> float:
    assert len(curve) == len(reference) == 30
    return max(abs(loss - base) / base for loss, base in zip(curve, reference, strict=True))


@pytest.fixture(scope="module")
def adamw_at_tp2_dp2(tmp_path_factory) -> list[float]:
    return losses(tmp_path_factory.mktemp("adamw") / "run", *TP2_DP2)


@pytest.mark.sweep
@pytest.mark.parametrize(
    "variant",
    [["optim=adamw8bit"], ["optim=adamw_bf16", "train.precision=bf16"]],
    ids=["adamw8bit", "adamw_bf16"],
)
def test_an_optimizer_state_variant_at_tp2_dp2_follows_adamw_within_2_percent(
    tmp_path, adamw_at_tp2_dp2, variant
):
    gap = worst_gap(losses(tmp_path / "run", *variant, *TP2_DP2), adamw_at_tp2_dp2)
    print(f"{variant}: worst per-step gap to adamw {gap:.2e}")
    assert gap <= 0.02


@pytest.mark.sweep
def test_adamw4bit_at_tp2_dp2_follows_its_own_run_on_one_process(tmp_path):
    """``adamw4bit`` misses the 2 % band by the 4-bit method's own gap (3.2e-2 at step 27, the same
    in a bare loop of torchao's AdamW4bit on one process: bench/adamw4bit_loop.py,
    docs/precision-and-memory.md); TP and FSDP split whole blocks, so the layout adds nothing."""
    sharded = losses(tmp_path / "sharded", "optim=adamw4bit", *TP2_DP2)
    single = losses(tmp_path / "single", "optim=adamw4bit")
    gap = worst_gap(sharded, single)
    print(f"adamw4bit tp=2 dp=2 against tp=1: worst per-step gap {gap:.2e}")
    assert gap <= 1e-4
