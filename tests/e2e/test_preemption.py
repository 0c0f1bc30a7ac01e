"""Preemption and async checkpoints through the command line (issue 24).

A SIGTERM to the recipe's process group (or its launcher), or a SIGUSR1 to one of its ranks, stops
every rank after the same step with a checkpoint of it (here with ``checkpoint.every_steps=0``) and
exit status 75; resume=auto then reproduces the uninterrupted losses exactly. A second signal ends
the run at once.
A run with ``checkpoint.async=true`` resumes exactly like a synchronous one. No assertion reads the
clock: a run is waited for by its metrics lines, and the timeouts only bound a hang.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from components.checkpoint.integrity import MARKER
from components.runtime.exit_status import STOPPED_STATUS
from components.runtime.launch import free_port
from tests import cli
from tests.e2e.test_failures import (
    COMMON,
    REPO,
    assert_said_on_lines_of_their_own,
    run_recipe,
    start_recipe,
    stderr_of,
)

STEPS = 10
RUN = [f"train.max_steps={STEPS}", "checkpoint.every_steps=0"]
HANG_S = 300  # only a bound for a hang


def metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(records: list[dict]) -> list[float]:
    return [record["loss"] for record in records]


def wait_for_step(process, output_dir: Path, step: int) -> None:
    deadline = time.monotonic() + HANG_S
    while len(metrics(output_dir)) < step:
        assert process.poll() is None, stderr_of(output_dir)[-3000:]
        assert time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.05)


def rank_pids(launcher_pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return children


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("preemption") / "uninterrupted"
    run_recipe(output_dir, *RUN)
    return metrics(output_dir)


def assert_stopped_with_checkpoint(process, output_dir: Path, signal_text: str) -> int:
    """The run ended with the stop status and a complete checkpoint of its last step; that step."""
    assert process.wait(timeout=HANG_S) == STOPPED_STATUS, stderr_of(output_dir)[-3000:]
    stopped_at = len(metrics(output_dir))
    assert 4 <= stopped_at < STEPS
    checkpoints = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{stopped_at:08d}"]
    assert (output_dir / "checkpoints" / checkpoints[0] / MARKER).exists()
    assert f"note: stopped by {signal_text}" in stderr_of(output_dir)
    assert f"after step {stopped_at} of {STEPS}" in stderr_of(output_dir)
    return stopped_at


def test_sigterm_to_the_process_group_checkpoints_the_step_and_resume_continues_exactly(
    tmp_path, uninterrupted
):
    """What Slurm and ``timeout`` send: every process of the group (the launcher and each rank)
    gets the SIGTERM, and each rank gets the launcher's copy too: one stop, not a second signal
    ending the ranks at once. The notes, through pipes (``| tee``), start lines of their own and
    say the status the run ends with."""
    output_dir = tmp_path / "run"
    process = start_recipe(output_dir, *RUN, piped=True)
    wait_for_step(process, output_dir, 4)
    os.killpg(process.pid, signal.SIGTERM)
    stopped_at = assert_stopped_with_checkpoint(process, output_dir, "SIGTERM")
    stop = f"note: stopped by SIGTERM after step {stopped_at} of {STEPS}: checkpoint "
    said = ["note: SIGTERM: the ranks finish their step", stop]
    errors = output_dir.with_suffix(".err").read_bytes()
    assert_said_on_lines_of_their_own(errors, *said)
    assert_said_on_lines_of_their_own(output_dir.with_suffix(".out").read_bytes())  # stdout's too
    assert errors.count(b"note: stopped by SIGTERM") == 1 and b"error:" not in errors
    assert errors.decode().strip().endswith("checkpoint.resume=auto continues (exit status 75)")

    run_recipe(output_dir, *RUN, "checkpoint.resume=auto")
    resumed = metrics(output_dir)
    assert [record["step"] for record in resumed] == list(range(1, STEPS + 1))
    assert losses(resumed) == losses(uninterrupted)  # exact on the CPU
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted]
    assert stopped_at < STEPS and "resumed from" in output_dir.with_suffix(".out").read_text()


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    output_dir = tmp_path / "run"
    process = start_recipe(output_dir, *RUN)
    wait_for_step(process, output_dir, 4)
    ranks = rank_pids(process.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGUSR1)  # one rank only
    # Rank 0 reports the stop; the signal reached rank 1 only.
    assert_stopped_with_checkpoint(process, output_dir, "a signal to another rank")


def test_a_second_signal_ends_the_run_at_once(tmp_path):
    output_dir = tmp_path / "run"
    # Every save waits 600 s before its publish: the stop's checkpoint is in the middle of its save.
    process = start_recipe(output_dir, *RUN, "debug.fault=slow_save@600")
    wait_for_step(process, output_dir, 1)  # training: the stop's save comes after a step
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + HANG_S
    while not list((output_dir / "checkpoints").glob("*.tmp")):  # the stop's save has started
        assert process.poll() is None and time.monotonic() < deadline, stderr_of(output_dir)[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=HANG_S) == 128 + signal.SIGTERM, stderr_of(output_dir)[-3000:]
    assert "error: stopped by SIGTERM" in stderr_of(output_dir)
    assert "death signal" not in stderr_of(output_dir)  # torch elastic's own line: ours says it
    assert not [path for path in (output_dir / "checkpoints").iterdir() if path.suffix != ".tmp"]


def test_async_checkpoints_resume_exactly_like_sync_ones(tmp_path, uninterrupted):
    output_dir = tmp_path / "async"
    every = ["checkpoint.every_steps=2", "checkpoint.async=true", "checkpoint.keep=null"]
    run_recipe(output_dir, *RUN[:1], *every, "train.stop_after=5")
    saved = {path.name for path in (output_dir / "checkpoints").iterdir()}
    assert {"step_00000002", "step_00000004"} <= saved  # each published after its async write
    assert not [name for name in saved if name.endswith(".tmp")]
    run_recipe(output_dir, *RUN[:1], *every, "checkpoint.resume=auto")
    resumed = metrics(output_dir)
    assert [record["step"] for record in resumed] == list(range(1, STEPS + 1))
    assert losses(resumed) == losses(uninterrupted)  # exact on the CPU
    assert "resumed from" in output_dir.with_suffix(".out").read_text()


def test_under_torchrun_a_signal_to_one_rank_ends_every_rank_with_the_status_it_says(tmp_path):
    """Under torchrun the stopped ranks exit 0 (another status would have torchrun report or
    restart them), and the note says 0. ``max_restarts``, which torchrun does not read (its own
    --max-restarts restarts ranks), is one note, not a refusal ending in torchrun's report."""
    output_dir = tmp_path / "torchrun"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    recipe = ["recipes/finetune.py", *COMMON, *RUN, "max_restarts=1", "checkpoint.resume=auto"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    environment = cli.warm_torchrun_environment(environment)  # workers start warm (tests/cli.py)
    with open(tmp_path / "torchrun.out", "w") as out, open(tmp_path / "torchrun.err", "w") as err:
        process = cli.Popen(
            [*torchrun, *recipe, f"output_dir={output_dir}"],
            cwd=REPO, env=environment, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_step(process, output_dir, 1)  # every rank past step 1: its handler installed
        os.kill(rank_pids(process.pid)[-1], signal.SIGUSR1)  # one rank only
        assert process.wait(timeout=HANG_S) == 0, stderr_of(output_dir)[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    printed, errors = stdout_of(output_dir), stderr_of(output_dir)
    stopped_at = len(metrics(output_dir))
    assert f"after step {stopped_at} of {STEPS}" in errors and stopped_at < STEPS, errors[-3000:]
    assert "(exit status 0 under torchrun, which would restart ranks that end otherwise)" in errors
    assert "exit status 75" not in printed + errors
    assert "FAILED" not in errors and "error:" not in errors, errors[-3000:]
    note = "note: max_restarts=1 is the recipe's own launcher's and is not read under torchrun"
    assert printed.count(note) == 1, printed[-3000:]
    assert (output_dir / "checkpoints" / f"step_{stopped_at:08d}" / MARKER).is_file()


def stdout_of(output_dir: Path) -> str:
    return output_dir.with_suffix(".out").read_text()
