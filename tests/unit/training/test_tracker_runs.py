"""The record of an output folder's tracker runs: continued only by a resumed run logging to the
same place; each tracker's entry kept when another's is written; a damaged file is no record."""

import json

from components.training.tracker_runs import (
    TRACKER_RUNS_FILE,
    continued_run,
    record_run,
    recorded_runs,
)

HERE = {"tracking_uri": "file:///runs/mlruns", "experiment_id": "7"}


def test_only_a_resumed_run_logging_to_the_same_place_continues_the_recorded_run(tmp_path):
    assert continued_run(tmp_path, "mlflow", 5, HERE) is None  # nothing recorded
    record_run(tmp_path, "mlflow", "run-a", HERE)
    assert continued_run(tmp_path, "mlflow", 5, HERE) == "run-a"
    assert continued_run(tmp_path, "mlflow", 0, HERE) is None  # a fresh run starts its own
    elsewhere = HERE | {"tracking_uri": "http://server:5000"}
    assert continued_run(tmp_path, "mlflow", 5, elsewhere) is None
    assert continued_run(tmp_path, "wandb", 5, {}) is None


def test_each_trackers_entry_stays_when_another_is_written(tmp_path):
    record_run(tmp_path, "mlflow", "run-a", HERE)
    record_run(tmp_path, "wandb", "w1", {"project": "p", "entity": None})
    record_run(tmp_path, "mlflow", "run-b", HERE)
    assert recorded_runs(tmp_path) == {
        "mlflow": {"run_id": "run-b", **HERE},
        "wandb": {"run_id": "w1", "project": "p", "entity": None},
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == [TRACKER_RUNS_FILE]  # no copies


def test_a_damaged_record_is_no_record(tmp_path):
    path = tmp_path / TRACKER_RUNS_FILE
    for text in ("{not json", "[1, 2]", json.dumps({"mlflow": {"run_id": 3}})):
        path.write_text(text)
        assert recorded_runs(tmp_path) == {}
        assert continued_run(tmp_path, "mlflow", 5, HERE) is None
