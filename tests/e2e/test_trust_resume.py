"""Output folders judged on their real paths, and settings changed at resume applied or refused,
through the real command line: a link into another run's folder, a folder inside one and one above
other runs are each one ``error:`` line that writes nothing, after which the other run resumes; a
changed lr, schedule or weight decay applies from the resumed step on, said in a ``note:``.

By default one case of each refusal (a link into a checkpoint, a folder two levels inside), each
followed by the other run's resume, and a changed lr and a changed schedule; the links into
checkpoints/ and hf/, the folders sub/ and tensorboard/ and a changed warmup run under
``-m sweep``: the same judgement of the real path, the same recomputed lr, again."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_trust import copy_of, error_line, run


def files_of(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def metric(output_dir: Path, name: str) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record[name] for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4 and its ``hf/`` export (copied by every
    test that lets it resume)."""
    folder = tmp_path_factory.mktemp("trained") / "run"
    result = run(folder, "train.max_steps=4", "checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "hf").is_dir() and (folder / "checkpoints" / "step_00000004").is_dir()
    return folder


def resumes_fine(folder: Path) -> None:
    again = run(folder, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {folder / 'checkpoints' / 'step_00000004'} at step 4" in again.stdout
    assert list(metric(folder, "loss")) == [1, 2, 3, 4, 5, 6]


def refused_writing_nothing(output_dir: Path, guarded: Path) -> str:
    before = files_of(guarded)
    line = error_line(run(output_dir, "train.max_steps=2"))
    assert files_of(guarded) == before  # not a config.yaml, run.json, metrics line or .lock
    return line


SWEEP = pytest.mark.sweep


@pytest.mark.parametrize(
    "into",
    [
        pytest.param("checkpoints", marks=SWEEP),
        pytest.param("hf", marks=SWEEP),
        "checkpoints/step_00000002",
    ],
)
def test_a_link_into_another_runs_folder_is_refused_and_that_run_resumes(trained, tmp_path, into):
    other = copy_of(trained, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(other / into, target_is_directory=True)
    line = refused_writing_nothing(link, other)
    assert line == (
        f"error: output_dir {link} (a link to {other / into}) is inside the output folder of "
        f"another run ({other}, with its run.json), whose pruning or overwrite would delete it: "
        f"nested output folders are not allowed; choose an output_dir outside {other}"
    )
    resumes_fine(other)


@pytest.mark.parametrize(
    "inside",
    [pytest.param("sub", marks=SWEEP), "sub/deeper", pytest.param("tensorboard", marks=SWEEP)],
)
def test_a_folder_inside_another_runs_folder_is_refused_and_that_run_resumes(
    trained, tmp_path, inside
):
    other = copy_of(trained, tmp_path)
    line = refused_writing_nothing(other / inside, other)
    assert line.startswith(f"error: output_dir {other / inside} is inside the output folder of "), (
        line
    )
    assert f"choose an output_dir outside {other}" in line, line
    assert not (other / inside.split("/")[0]).exists()
    resumes_fine(other)


def test_a_folder_above_other_runs_is_refused_not_claimed(trained, tmp_path):
    above = tmp_path / "outputs"
    for where in ("llama/2026-12-01_20-00-00", "llama/2026-12-01_21-00-00", "qwen3/mine"):
        shutil.copytree(trained, above / where, ignore=shutil.ignore_patterns(".lock"))
    line = refused_writing_nothing(above, above)
    assert line == (
        f"error: output_dir {above} holds the output folder of another run below it "
        f"({above / 'llama' / '2026-12-01_20-00-00'}, with its run.json): nested output folders "
        "are not allowed; choose an output_dir that holds no other run's folder"
    )
    assert sorted(path.name for path in above.iterdir()) == ["llama", "qwen3"]  # not claimed
    resumes_fine(above / "qwen3" / "mine")


STOPPED = ["train.max_steps=8", "train.warmup_steps=2", "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run of 8 steps stopped after step 4 (lr 3e-3, warmup_cosine, no weight decay)."""
    folder = tmp_path_factory.mktemp("stopped") / "run"
    result = run(folder, *STOPPED, "train.stop_after=4")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def unchanged(stopped, tmp_path_factory) -> Path:
    """The stopped run resumed with its own settings, to step 8."""
    folder = copy_of(stopped, tmp_path_factory.mktemp("unchanged"))
    result = run(folder, *STOPPED, "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "changed settings" not in result.stdout
    return folder


def resumed(stopped: Path, tmp_path: Path, *changes: str) -> tuple[Path, str]:
    folder = copy_of(stopped, tmp_path)
    result = run(folder, *STOPPED, "checkpoint.resume=auto", *changes)
    assert result.returncode == 0, result.stderr[-3000:]
    (note,) = [line for line in result.stdout.splitlines() if "changed settings" in line]
    return folder, note


def fresh(tmp_path: Path, *changes: str) -> Path:
    folder = tmp_path / "fresh"
    result = run(folder, *STOPPED, *changes)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.mark.parametrize(
    "changes, named",
    [
        (["optim.lr=1e-2"], "optim.lr 0.003 -> 0.01"),
        (
            ["schedule=linear"],
            "schedule warmup_cosine -> linear, schedule.min_lr_ratio 0.1 -> unset",
        ),
        pytest.param(["train.warmup_steps=4"], "train.warmup_steps 2 -> 4", marks=SWEEP),
    ],
    ids=["lr", "schedule", "warmup"],
)
def test_a_changed_schedule_at_resume_sets_the_lr_from_the_resumed_step_on(
    stopped, unchanged, tmp_path, changes, named
):
    folder, note = resumed(stopped, tmp_path, *changes)
    assert note == (
        f"note: resuming from step 4 with changed settings, applied from step 5 on: {named}"
    )
    new, old = metric(fresh(tmp_path, *changes), "lr"), metric(unchanged, "lr")
    lr = metric(folder, "lr")
    assert [lr[step] for step in range(1, 5)] == [old[step] for step in range(1, 5)]
    assert [lr[step] for step in range(5, 9)] == [new[step] for step in range(5, 9)]  # exactly
    assert all(new[step] != old[step] for step in range(5, 9))  # a change the test can see


def test_a_changed_weight_decay_at_resume_is_applied(stopped, unchanged, tmp_path):
    changed, note = resumed(stopped, tmp_path, "optim.weight_decay=0.5")
    assert note.endswith("applied from step 5 on: optim.weight_decay 0.0 -> 0.5"), note
    same = unchanged
    assert metric(changed, "lr") == metric(same, "lr")
    decayed, kept = metric(changed, "loss"), metric(same, "loss")
    # step 5's loss is measured before its update, the first that decays the weights
    assert [decayed[step] for step in range(1, 6)] == [kept[step] for step in range(1, 6)]
    assert all(decayed[step] != kept[step] for step in range(6, 9))


def test_a_change_a_resume_cannot_apply_is_one_error_line(stopped, tmp_path):
    folder = copy_of(stopped, tmp_path)
    before = files_of(folder)
    result: subprocess.CompletedProcess = run(
        folder, *STOPPED, "checkpoint.resume=auto", "+optim.amsgrad=true"
    )
    assert error_line(result) == (
        f"error: cannot resume from {folder / 'checkpoints' / 'step_00000004'}: optim.amsgrad is "
        "True but the checkpoint was written with 'unset' (AdamW's max_exp_avg_sq state is kept "
        "only with amsgrad=true); drop optim.amsgrad to resume"
    )
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        error_line(result)
    ]
    assert files_of(folder) == before
