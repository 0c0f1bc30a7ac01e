"""HSDP through the real command line: ``dp_replicate=2 dp_shard=2`` (4 ranks, FSDP2 over a 2-D
mesh: replicated across the pair of groups, sharded within each) trains the same 4 steps as the
single-process twin, SGD and AdamW, fp32 on the CPU (losses and grad norms within 1e-5 relative;
measured ~3e-8), and its AdamW checkpoint of step 2 resumes on one process to the same steps 3-4;
and ``dp_replicate=2 tp=2`` trains the same 4 steps as ``tp=2`` alone with SGD.

One ``--multirun`` sweep runs both optimizers on 4 ranks, one sweep their twins on one process, one
sweep ``tp=2`` with and without the replicas.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


def finetune(*overrides: str, sweep: bool = False) -> None:
    """One run, or with ``sweep`` one ``--multirun`` sweep (its jobs in output_dir/0, /1, ...)."""
    flags = ["--multirun"] if sweep else []
    command = [sys.executable, "recipes/finetune.py", *flags, *COMMON, *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"


def curves(folder: Path) -> list[tuple[int, float, float]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def assert_same(ours, theirs) -> None:
    assert [step for step, _, _ in ours] == [1, 2, 3, 4]
    for (_, loss, norm), (_, want_loss, want_norm) in zip(ours, theirs, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)


def test_replicas_over_tp_train_like_tp_alone(tmp_path):
    """FSDP2's replicate dim over a tp mesh: each replica's gradients all-reduced, nothing sharded
    (measured ~3e-8 with SGD; AdamW: docs/parallelism.md)."""
    finetune("optim=sgd", "tp=2", "dp_replicate=1,2", f"output_dir={tmp_path}", sweep=True)
    assert_same(curves(tmp_path / "1"), curves(tmp_path / "0"))


def test_hsdp_trains_and_resumes_like_one_process(tmp_path):
    hsdp, twin, resumed = tmp_path / "hsdp", tmp_path / "twin", tmp_path / "resumed"
    optimizers = "optim=sgd,adamw"  # jobs 0 and 1 of each sweep
    layout = ["dp_replicate=2", "dp_shard=2", "checkpoint.every_steps=2"]
    finetune(*layout, optimizers, f"output_dir={hsdp}", sweep=True)
    finetune(optimizers, f"output_dir={twin}", sweep=True)
    for job in ("0", "1"):
        assert_same(curves(hsdp / job), curves(twin / job))
    step_2 = hsdp / "1" / "checkpoints" / "step_00000002"
    finetune("optim=adamw", f"checkpoint.resume={step_2}", f"output_dir={resumed}")
    again = curves(resumed)
    assert [step for step, _, _ in again] == [3, 4]
    for (_, loss, norm), (_, want_loss, want_norm) in zip(
        again, curves(hsdp / "1")[2:], strict=True
    ):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        assert norm == pytest.approx(want_norm, rel=1e-6)
