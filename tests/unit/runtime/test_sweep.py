"""A --multirun sweep runs every job, whatever the one before did, and ends with their statuses."""

import pytest

from components.runtime.sweep import Sweep, sweep_summary


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
