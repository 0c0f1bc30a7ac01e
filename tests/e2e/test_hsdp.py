"""HSDP through the real command line: ``dp_replicate=2 dp_shard=2`` (4 ranks, FSDP2 over a 2-D
mesh: replicated across the pair of groups, sharded within each) trains the same 4 steps as the
single-process twin, SGD and AdamW, fp32 on the CPU (losses and grad norms within 1e-5 relative;
measured ~3e-8), and its AdamW checkpoint of step 2 resumes on one process to the same steps 3-4;
and ``dp_replicate=2 tp=2`` trains the same 4 steps as tp=2 alone and as one process with SGD.

One ``--multirun`` sweep runs both optimizers on 4 ranks; the module's one sweep of their twins on
one process is the reference of both tests.
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


OPTIMIZERS = "optim=sgd,adamw"  # jobs 0 and 1 of each sweep


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> Path:
    """The one-process runs of both optimizers: jobs 0 (SGD) and 1 (AdamW) in its folder."""
    folder = tmp_path_factory.mktemp("twin")
    finetune(OPTIMIZERS, f"output_dir={folder}", sweep=True)
    return folder


def test_replicas_over_tp_train_like_tp_alone_and_one_process(twin, tmp_path):
    """FSDP2's replicate dim over a tp mesh: each replica's gradients all-reduced, nothing sharded;
    against tp=2 alone with SGD (measured ~3e-8; AdamW: docs/parallelism.md) and one process."""
    replicas, tp_alone = tmp_path / "replicas", tmp_path / "tp_alone"
    finetune("optim=sgd", "tp=2", "dp_replicate=2", f"output_dir={replicas}")
    finetune("optim=sgd", "tp=2", f"output_dir={tp_alone}")
    assert_same(curves(replicas), curves(tp_alone))
    assert_same(curves(replicas), curves(twin / "0"))


def test_hsdp_trains_and_resumes_like_one_process(twin, tmp_path):
    hsdp, resumed = tmp_path / "hsdp", tmp_path / "resumed"
    layout = ["dp_replicate=2", "dp_shard=2", "checkpoint.every_steps=2"]
    finetune(*layout, OPTIMIZERS, f"output_dir={hsdp}", sweep=True)
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
