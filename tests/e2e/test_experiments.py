"""Runs as experiments through the real command line: a sweep writes one folder per job, each with
the config it ran with, and a tracker chosen by ``logger=`` gets a loss per step."""

import json
import os
import sys
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import cli

REPO = Path(__file__).resolve().parents[2]


def test_a_two_job_sweep_leaves_two_folders_with_their_metrics_config_and_events(tmp_path):
    sweep = tmp_path / "sweep"
    command = [
        sys.executable,
        "recipes/finetune.py",
        "--multirun",
        "optim.lr=0.001,0.003",
        "logger=tensorboard",
    ]
    command += [
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.val_every=0",
        "checkpoint.export=false",
    ]
    command += ["data.num_examples=200", f"output_dir={sweep}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {}
    for job, lr in (("0", 0.001), ("1", 0.003)):
        folder = sweep / job
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["optim"]["lr"] == lr and config["output_dir"] == str(folder)
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        events = EventAccumulator(str(folder / "tensorboard"))
        events.Reload()
        scalars = events.Scalars("loss")
        assert [e.step for e in scalars] == [1, 2]
        # TensorBoard stores float32: the same loss to float32 precision.
        assert all(
            abs(e.value - r["loss"]) <= 1e-6 * r["loss"]
            for e, r in zip(scalars, records, strict=True)
        )
        losses[job] = records[-1]["loss"]
    assert losses["0"] != losses["1"]  # each job trained with its own lr


def test_a_sweep_runs_every_job_after_a_bad_one_and_ends_with_a_summary(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "recipes/finetune.py", "--multirun", "optim.lr=-1,0.001"]
    command += ["train.max_steps=1", "train.val_every=0", "checkpoint.export=false"]
    command += ["data.num_examples=200", f"output_dir={sweep}"]
    result = cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]  # the first failed job's status
    assert "error: optim.lr=-1 is not valid" in result.stderr
    assert (sweep / "1" / "metrics.jsonl").is_file()  # the job after the bad one ran
    assert not (sweep / "0").exists()  # the refused job left no empty folder
    assert result.stderr.strip().splitlines()[-3:] == [
        "sweep: 1 of 2 jobs done, 1 failed",
        "  job 0 (optim.lr=-1): failed (exit status 2)",
        "  job 1 (optim.lr=0.001): done",
    ]
