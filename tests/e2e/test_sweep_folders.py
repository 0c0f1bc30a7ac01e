"""A ``--multirun`` sweep through the real command line never writes into another run's folder nor
another sweep's: refused in one ``error:`` line before Hydra writes its ``multirun.yaml`` or a job's
folder there; the same sweep run again is not refused; a sweep whose jobs are all refused leaves
nothing behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.max_steps=1", "train.val_every=0", "checkpoint.export=false"]
SMALL += ["checkpoint.every_steps=1", "data.num_examples=200"]
VALUES = "optim.lr=0.001,0.003"


def sweep(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "recipes/finetune.py", "--multirun", *overrides, *SMALL]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(
        [*command, f"output_dir={output_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` (its path there) with its bytes; folders as empty values."""
    return {
        str(path.relative_to(folder)): path.read_bytes() if path.is_file() else b""
        for path in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """The folder of a finished sweep of two jobs, each checkpointed at its last step."""
    folder = tmp_path_factory.mktemp("swept") / "sweep"
    result = sweep(folder, VALUES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in folder.iterdir()) == ["0", "1", "multirun.yaml"]
    return folder


def test_a_sweep_into_a_runs_folder_or_another_sweeps_is_refused_before_writing(swept):
    before = tree(swept)
    into_a_run = sweep(swept / "0", VALUES)  # job 0's folder holds a finished run
    assert into_a_run.returncode == 2
    assert into_a_run.stderr.strip().splitlines() == [
        f"error: output_dir {swept / '0'} is the output folder of a run (with its run.json): a "
        f"--multirun sweep writes its jobs' folders {swept / '0'}/0, {swept / '0'}/1, ... and "
        "never inside another run's folder; choose another output_dir"
    ]
    assert tree(swept) == before  # no multirun.yaml, no 0/, 1/ inside the run's folder

    other_values = sweep(swept, "optim.lr=0.002,0.004")
    assert other_values.returncode == 2
    (line,) = other_values.stderr.strip().splitlines()
    assert line.startswith(
        f"error: output_dir {swept} holds the jobs of another sweep (its multirun.yaml: "
        f"{VALUES} train.max_steps=1 "
    ), line
    assert line.endswith(
        "run that sweep's own command again (checkpoint.resume=auto continues its jobs)"
    )
    assert tree(swept) == before  # the first sweep's multirun.yaml still says its own values


def test_the_same_sweep_again_continues_its_own_jobs(swept):
    runs = {job: tree(swept / job) for job in ("0", "1")}
    again = sweep(swept, VALUES, "checkpoint.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    for job in ("0", "1"):
        assert f"the run in {swept / job} is already complete at step 1" in again.stdout
        assert tree(swept / job) == runs[job]


def test_a_sweep_whose_jobs_are_all_refused_leaves_nothing(tmp_path):
    folder = tmp_path / "new" / "sweep"
    result = sweep(folder, "optim.lr=-1,-2")
    assert result.returncode == 2
    assert "error: optim.lr=-2 is not valid" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no multirun.yaml, no empty 0/, 1/, nor new/
