"""checkpoint.resume=auto over a folder whose run left no checkpoint: an earlier attempt of the
same config that stopped before its end starts again from step 0; a finished one, another config's
or any folder without resume=auto stays refused (tests/e2e/test_failures.py runs the kill -9)."""

import json
from pathlib import Path

import pytest

from components.checkpoint.integrity import MARKER
from components.runtime.output_dir import claim_output_dir, config_hash
from recipes.compose import compose
from recipes.outputs import finished, starts_again
from recipes.validate import validate

RUN = ["train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.resume=auto"]


@pytest.fixture(scope="module")
def settings():
    return validate(compose(RUN))


def attempt(folder: Path, settings, steps: int) -> str:
    """A folder as an attempt of ``settings`` left it after ``steps`` steps; its config hash."""
    digest = config_hash(settings.model_dump(by_alias=True))
    claim_output_dir(folder, digest, continuing=False, overwrite=False, resumable=False)
    lines = [json.dumps({"step": step, "loss": 5.0}) for step in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return digest


def test_an_attempt_of_the_same_config_without_a_checkpoint_starts_again(tmp_path, settings):
    digest = attempt(tmp_path, settings, 3)
    assert starts_again(settings, tmp_path, digest)
    (tmp_path / "checkpoints" / "step_00000010.tmp").mkdir(parents=True)  # killed in its save
    assert starts_again(settings, tmp_path, digest)


def test_another_config_or_no_resume_auto_stays_refused(tmp_path, settings):
    attempt(tmp_path, settings, 3)
    other = validate(compose([*RUN, "optim.lr=0.001"]))
    assert not starts_again(other, tmp_path, config_hash(other.model_dump(by_alias=True)))
    fresh = validate(compose([*RUN[:2], "checkpoint.resume=null"]))
    digest = attempt(tmp_path / "fresh", fresh, 3)
    assert not starts_again(fresh, tmp_path / "fresh", digest)


def test_an_attempt_that_reached_its_end_or_its_export_is_never_started_again(tmp_path, settings):
    digest = attempt(tmp_path / "ended", settings, 30)
    assert not starts_again(settings, tmp_path / "ended", digest)
    digest = attempt(tmp_path / "exported", settings, 3)
    (tmp_path / "exported" / "hf").mkdir()
    assert not starts_again(settings, tmp_path / "exported", digest)


def test_a_complete_checkpoint_is_resumed_not_started_again(tmp_path, settings):
    digest = attempt(tmp_path, settings, 12)
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000010" / MARKER).write_text("")
    assert not starts_again(settings, tmp_path, digest)


def test_a_finished_run_without_checkpoints_is_found_complete(tmp_path):
    """every_steps=0: the same config's run, its metrics at max_steps and its export there, is
    complete (nothing to train, status 0: the recipe's "already complete" line), not refused;
    one that stopped early, or lacks its export, is not complete."""
    run = ["train.max_steps=30", "checkpoint.every_steps=0", "checkpoint.resume=auto"]
    settings = validate(compose(run))
    attempt(tmp_path / "ended", settings, 30)
    (tmp_path / "ended" / "hf").mkdir()
    assert finished(settings, tmp_path / "ended", {}, {})
    attempt(tmp_path / "unexported", settings, 30)
    assert not finished(settings, tmp_path / "unexported", {}, {})
    attempt(tmp_path / "early", settings, 12)
    (tmp_path / "early" / "hf").mkdir()
    assert not finished(settings, tmp_path / "early", {}, {})
    other = validate(compose([*run, "optim.lr=0.001"]))
    assert not finished(other, tmp_path / "ended", {}, {})
