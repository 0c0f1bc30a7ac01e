"""A --multirun sweep runs every job, whatever the one before did, and ends with their statuses;
its folder is refused when it is or holds another run's or sweep's."""

from pathlib import Path

import pytest
import yaml

from components.runtime.sweep import Sweep, sweep_summary
from components.runtime.sweep_folder import sweep_folder_errors


def test_a_failed_job_is_noted_and_the_sweep_goes_on():
    sweep = Sweep()
    jobs, sweep_job = sweep.jobs, sweep.run_job

    def bad_input():
        raise SystemExit(2)

    def crash():
        raise RuntimeError("rank 1 failed")

    sweep_job(0, ["lr=-1"], bad_input)
    sweep_job(1, ["lr=1"], crash)
    sweep_job(2, ["lr=2"], lambda: None)
    assert jobs == [(0, ["lr=-1"], 2), (1, ["lr=1"], 1), (2, ["lr=2"], 0)]
    lines, status = sweep_summary(jobs)
    assert status == 2 and lines[0] == "sweep: 1 of 3 jobs done, 2 failed"
    assert lines[1:] == [
        "  job 0 (lr=-1): failed (exit status 2)",
        "  job 1 (lr=1): failed (exit status 1)",
        "  job 2 (lr=2): done",
    ]


def test_ctrl_c_stops_the_sweep_and_says_the_rest_did_not_run():
    sweep = Sweep()
    jobs, sweep_job = sweep.jobs, sweep.run_job

    def interrupted():
        raise SystemExit(130)

    sweep_job(0, ["a=1", "b=1"], lambda: None)
    with pytest.raises(SystemExit):
        sweep_job(1, ["a=1", "b=2"], interrupted)
    lines, status = sweep_summary(jobs)
    assert status == 130 and lines[1] == "  job 0 (b=1): done"
    assert lines[-1].endswith("after job 1: later jobs did not run")


def test_a_sweep_of_good_jobs_exits_0():
    assert sweep_summary([(0, ["x=1"], 0), (1, ["x=2"], 0)])[1] == 0


def test_a_job_stopped_with_a_checkpoint_stops_the_sweep_and_says_how_to_resume():
    """SIGTERM or SIGUSR1 stops a job after a step with a checkpoint (status 75): the later jobs
    do not run (each would set up, train a step and stop), and the summary says which was
    stopped, not failed."""
    sweep = Sweep()

    def preempted():
        raise SystemExit(75)

    sweep.run_job(0, ["lr=1"], lambda: None)
    with pytest.raises(SystemExit) as stop:
        sweep.run_job(1, ["lr=2"], preempted)
    assert stop.value.code == 75
    lines, status = sweep_summary(sweep.jobs)
    assert status == 75
    assert lines == [
        "sweep: 1 of 2 jobs done, 0 failed, 1 stopped",
        "  job 0 (lr=1): done",
        "  job 1 (lr=2): stopped with a checkpoint (exit status 75): resume it with resume=auto",
        "  the sweep was stopped by a signal after job 1: later jobs did not run",
    ]


def run_folder(folder: Path) -> Path:
    """A folder as a run leaves it: its run.json and metrics."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text("{}")
    (folder / "metrics.jsonl").write_text("")
    return folder


def sweep_record(folder: Path, overrides: list[str]) -> None:
    """Hydra's multirun.yaml of a sweep of ``overrides`` (the parts of it a sweep is told by)."""
    hydra = {"job": {"config_name": "config"}, "overrides": {"task": overrides}}
    (folder / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra, "seed": 0}))


def test_a_sweeps_folder_inside_a_run_or_above_runs_without_a_sweep_is_refused(tmp_path):
    run = run_folder(tmp_path / "run")
    (inside,) = sweep_folder_errors(run / "sweep", "config", ["optim.lr=1,2"])
    assert inside.startswith(f"output_dir {run / 'sweep'} is inside the output folder of another")
    run_folder(tmp_path / "runs" / "llama" / "today")
    (above,) = sweep_folder_errors(tmp_path / "runs", "config", ["optim.lr=1,2"])
    assert above.startswith(
        f"output_dir {tmp_path / 'runs'} holds the output folder of another run below it "
        f"({tmp_path / 'runs' / 'llama' / 'today'}, with its run.json) and no sweep's multirun.yaml"
    )


def test_a_sweeps_own_folder_is_taken_again_and_another_sweeps_only_once_it_has_no_run(tmp_path):
    folder = tmp_path / "sweep"
    run_folder(folder / "0")
    sweep_record(folder, ["optim.lr=1,2", "seed=3"])
    assert sweep_folder_errors(folder, "config", ["optim.lr=1,2", "seed=3"]) == []
    continued = ["optim.lr=1,2", "checkpoint.resume=auto", "seed=3", "overwrite_output_dir=true"]
    assert sweep_folder_errors(folder, "config", continued) == []
    (other,) = sweep_folder_errors(folder, "config", ["optim.lr=1,3", "seed=3"])
    assert "holds the jobs of another sweep (its multirun.yaml: optim.lr=1,2 seed=3)" in other
    assert sweep_folder_errors(folder, "dpo", ["optim.lr=1,2", "seed=3"]) == [other]
    (folder / "0" / "run.json").unlink()  # a job folder without a run's files is no run
    (folder / "0" / "metrics.jsonl").unlink()
    assert sweep_folder_errors(folder, "config", ["optim.lr=1,3", "seed=3"]) == []


def test_a_sweeps_folder_that_is_a_file_or_under_one_is_refused_as_a_runs_would_be(tmp_path):
    (tmp_path / "notes").write_text("")
    assert sweep_folder_errors(tmp_path / "notes", "config", ["optim.lr=1,2"]) == [
        f"output_dir='{tmp_path / 'notes'}' is a file, not a folder: choose another output_dir"
    ]
    (under,) = sweep_folder_errors(tmp_path / "notes" / "sweep", "config", ["optim.lr=1,2"])
    assert under.endswith(
        f"cannot be created: {tmp_path / 'notes'} is a file; choose another output_dir"
    )
