"""A resumed run continues its tracker's run, through the command line with the real trackers.

The scenario a user hits: a run with ``checkpoint.resume=auto`` is killed (here its only rank,
``debug.fault=kill@4``: a SIGKILL at step 4, as a ``kill -9`` leaves it) after its checkpoint of
step 2, then the same command runs again and resumes after step 2. The tracker must then hold one
run with steps 1-6: MLflow the same run, finished, with step 3 twice (it cannot remove a value,
and says so); W&B (offline) the same run id, the resumed attempt's file rewound to step 0 and
holding steps 1-6 (what ``wandb sync`` hands W&B's server, which cuts the history there), since the
killed attempt's file lost what W&B had not written yet.
"""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.training.loggers import RESUMES_TAG
from components.training.tracker_runs import TRACKER_RUNS_FILE
from tests.e2e.test_failures import metrics, start_recipe, stderr_of
from tests.unit.training.test_loggers import key_of, wandb_records

RUN = ["tp=1", "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.resume=auto"]


def killed_then_resumed(output_dir: Path, *overrides: str, env: dict | None = None) -> None:
    """The run killed at step 4 (after logging steps 1-3), then the same command without the
    fault: it resumes after step 2 and ends."""
    killed = start_recipe(output_dir, *RUN, *overrides, "debug.fault=kill@4", env=env)
    assert killed.wait(timeout=300) != 0
    assert "rank 0 failed: killed by SIGKILL" in stderr_of(output_dir)
    assert [record["step"] for record in metrics(output_dir)] == [1, 2, 3]
    resumed = start_recipe(output_dir, *RUN, *overrides, env=env)
    assert resumed.wait(timeout=300) == 0, stderr_of(output_dir)[-3000:]


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("trackers") / "ml"
    killed_then_resumed(output_dir, "logger=mlflow")
    return output_dir


def test_a_resumed_run_continues_its_mlflow_run_and_finishes_it(mlflow_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store so only
    client = MlflowClient(tracking_uri=(mlflow_run / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "shardtune"]
    (run,) = client.search_runs([experiment.experiment_id])  # one run, not one per attempt
    recorded = json.loads((mlflow_run / TRACKER_RUNS_FILE).read_text())["mlflow"]
    assert recorded["run_id"] == run.info.run_id and run.info.run_name == "ml"
    assert run.info.status == "FINISHED"  # the killed attempt's RUNNING is over
    loss = {record["step"]: record["loss"] for record in metrics(mlflow_run)}
    history = client.get_metric_history(run.info.run_id, "loss")
    history = sorted(history, key=lambda metric: (metric.step, metric.timestamp))
    steps = [1, 2, 3, 3, 4, 5, 6]  # step 3: the killed attempt's value, then the resumed one's
    assert [metric.step for metric in history] == steps
    assert [metric.value for metric in history] == pytest.approx([loss[s] for s in steps], 1e-5)
    first_step, began = run.data.tags[RESUMES_TAG].split("@")
    assert first_step == "2"
    assert history[2].timestamp < int(began) <= history[3].timestamp  # which attempt logged which
    assert run.data.metrics["loss"] == pytest.approx(loss[6], abs=1e-5)
    said = stderr_of(mlflow_run)
    assert f"note: logger=mlflow: continuing MLflow run {run.info.run_id} after step 2" in said
    assert "MLflow cannot remove a logged value: the stopped attempt's values at step 3" in said
    assert "debug.fault kill@4 -> None" in said  # the parameter MLflow would not let change


def test_a_resumed_run_rewinds_its_wandb_run_and_gives_it_the_steps_a_kill_lost(tmp_path):
    output_dir = tmp_path / "wb"
    home = {key: str(tmp_path / "wandb-home") for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR")}
    quick = ["+logger.settings.x_disable_stats=true", "+logger.settings.x_disable_meta=true"]
    killed_then_resumed(output_dir, "logger=wandb", *quick, env=home | {"WANDB_SILENT": "true"})
    recorded = json.loads((output_dir / TRACKER_RUNS_FILE).read_text())["wandb"]
    killed, resumed = [run_file(output_dir, attempt) for attempt in (0, 1)]
    assert killed.name == resumed.name == f"run-{recorded['run_id']}.wandb"  # one W&B run id
    # W&B writes its file in 32 KiB blocks: the kill lost what was not written (here: all).
    assert history(killed, "_step") == [1, 2, 3][: len(history(killed, "_step"))]
    assert history(resumed, "_step") == [1, 2, 3, 4, 5, 6]  # 1-2 again from metrics.jsonl
    loss = [record["loss"] for record in metrics(output_dir)]
    assert history(resumed, "loss") == pytest.approx(loss, abs=1e-5)
    (run,) = [r.run for r in wandb_records(resumed) if r.WhichOneof("record_type") == "run"]
    rewind, run_id = run.branch_point, recorded["run_id"]  # what `wandb sync` hands the server
    assert (run.run_id, rewind.run, rewind.metric, rewind.value) == (run_id, run_id, "_step", 0.0)
    said = stderr_of(output_dir)
    assert f"note: logger=wandb: continuing W&B run {recorded['run_id']} after step 2" in said
    assert "rewound to step 0 (what earlier attempts logged after it is cut once `wandb" in said
    assert "then steps 1-2 logged again from metrics.jsonl" in said


def run_file(output_dir: Path, attempt: int) -> Path:
    """The W&B file of the run's ``attempt``-th start (its folders are named by start time)."""
    (found,) = sorted((output_dir / "wandb").glob("offline-run-*"))[attempt].glob("run-*.wandb")
    return found


def history(path: Path, key: str) -> list:
    """The values of ``key`` in the history rows of a W&B run file."""
    rows = [r.history.item for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]
    return [json.loads(item.value_json) for row in rows for item in row if key_of(item) == key]
