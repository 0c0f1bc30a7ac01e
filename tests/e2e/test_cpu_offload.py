"""``train.cpu_offload=true`` (FSDP2's ``CPUOffloadPolicy`` on every ``fully_shard``, and FSDP at
dp=1 as a one-rank shard) through the real command line. On this CPU host and device memory are
one, so the policy moves nothing: every run must equal the same run without it, step by step, to
fp32's rounding (1e-7; exactly but where offload's reduce of each micro-batch sums the same fp32
gradients in another order: sequence parallelism's norms, micro-batches accumulating over dp).
What that proves is that the recipes, FSDP at dp=1 (against no FSDP), the optimizers, QLoRA's
NF4 base and checkpoints compose with the policy (refused with ep > 1 and pp > 1:
tests/unit/distributed/test_layout.py). What it moves on CUDA, and the device memory it saves,
is the cuda lane's (tests/cuda/test_cpu_offload.py).

make test runs AdamW at dp=2, SGD at tp=2 (FSDP's one-rank shard against none) and a resume across
the key; the other families and recipes run under ``-m sweep``.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.e2e.test_trust import REPO, SMALL

STEPS = ["train.max_steps=3", "checkpoint.export=false"]
SWEEP = pytest.mark.sweep
CASES = {
    "adamw_dp2": ("finetune.py", ["dp=2"]),
    "sgd_tp2": ("finetune.py", ["tp=2", "optim=sgd"]),
    "qlora_dp2": ("finetune.py", ["peft=qlora", "dp=2"]),
    "adamw8bit_dp2": ("finetune.py", ["optim=adamw8bit", "dp=2"]),
    "qwen3_moe_dp2": ("finetune.py", ["model=qwen3_moe", "dp=2"]),
    "qwen3_tp2_sp": ("finetune.py", ["model=qwen3", "tp=2", "sp=true"]),
    "dpo_tp2": ("dpo.py", ["tp=2"]),
    "distill_dp2": ("distill.py", ["dp=2"]),
}
IN_MAKE_TEST = ("adamw_dp2", "sgd_tp2")


def train(recipe: str, output_dir: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, f"recipes/{recipe}", *SMALL, *STEPS, f"output_dir={output_dir}"]
    result = cli.run(
        [*command, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "case", [c if c in IN_MAKE_TEST else pytest.param(c, marks=SWEEP) for c in CASES]
)
def test_a_run_with_cpu_offload_equals_the_run_without_it_on_the_cpu(tmp_path, case):
    recipe, layout = CASES[case]
    kept = train(recipe, tmp_path / "kept", *layout)
    offloaded = train(recipe, tmp_path / "offloaded", *layout, "train.cpu_offload=true")
    assert [r["step"] for r in offloaded] == [1, 2, 3]
    for record, again in zip(kept, offloaded, strict=True):
        assert again["loss"] == pytest.approx(record["loss"], rel=1e-7, abs=0), (record, again)
        grad_norm = pytest.approx(record["grad_norm"], rel=1e-7, abs=0)
        assert again["grad_norm"] == grad_norm, (record, again)


def test_with_accumulation_over_dp_each_micro_batch_is_reduced_and_the_run_follows(tmp_path):
    """Offloaded, FSDP reduce-scatters each micro-batch's gradients into the host's shards (the
    recipe's ``reduce_each_micro_batch``): two micro-batches a rank at dp=2 sum in another order
    than one reduce of their sum, so the run follows the one without the key to rounding."""
    accumulating = ["dp=2", "train.global_batch_size=8"]
    kept = train("finetune.py", tmp_path / "kept", *accumulating)
    offloaded = train(
        "finetune.py", tmp_path / "offloaded", *accumulating, "train.cpu_offload=true"
    )
    for record, again in zip(kept, offloaded, strict=True):
        assert again["loss"] == pytest.approx(record["loss"], rel=1e-6), (record, again)
        assert again["grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-5), (record, again)


def test_a_checkpoint_resumes_across_cpu_offload_exactly(tmp_path):
    """A run saved without the key resumes with it (FSDP's one-rank shard at tp=1 against plain
    tensors), and its steps equal the uninterrupted run's."""
    saving = ["train.max_steps=4", "checkpoint.every_steps=2"]
    whole = train("finetune.py", tmp_path / "whole", *saving)
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed = train(
        "finetune.py",
        tmp_path / "resumed",
        "train.max_steps=4",
        "train.cpu_offload=true",
        f"checkpoint.resume={checkpoint}",
    )
    assert [r["step"] for r in resumed] == [3, 4]
    for record, again in zip(whole[2:], resumed, strict=True):
        assert again["loss"] == record["loss"], (record, again)
        assert again["grad_norm"] == record["grad_norm"], (record, again)
