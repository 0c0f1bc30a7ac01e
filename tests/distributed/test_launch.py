"""launch_local's process handling, on real forked ranks started by a real launcher in a subprocess:
ranks die with a SIGKILLed launcher, a SIGSTOPped rank is named as the stuck one, error lines start
a line, bad input prints one line from rank 0, and no torch elastic folder is left in the temporary
directory."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from components.runtime.launch import RankExit, _report_failure
from tests import cli

REPO = Path(__file__).resolve().parents[2]
# Generous bounds that only a real orphan or hang exceeds (no timing is asserted beyond them).
GONE_WITHIN_S = 60
# Each rank notes its pid in argv[1], then all-reduces forever (or does what argv[2] says).
RANKS = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from components.runtime.launch import fail_once, launch_local
    from components.runtime.world import init_process_group

    def work(folder, mode):
        # 3 s: a SIGSTOPped peer's collective fails fast; bad input's barrier waits for a slow start
        init_process_group("gloo", timedelta(seconds=30 if mode == "bad_input" else 3))
        rank = dist.get_rank()
        open(os.path.join(folder, f"{rank}.pid"), "w").write(str(os.getpid()))
        if mode == "bad_input":  # as the recipe: after its collectives, the group destroyed
            dist.barrier()
            dist.destroy_process_group()
            fail_once("train.seq_len=0 must be positive")
        for step in range(1_000_000):
            dist.all_reduce(torch.ones(1))
            if mode == "bar" and rank == 0 and step == 5:
                sys.stderr.write("\\r 40%|####      | 4/10 [00:01<00:01]")
                sys.stderr.flush()
            if mode == "bar" and rank == 1 and step == 10:
                raise ValueError("injected")
            time.sleep(0.01)

    launch_local(work, 2, sys.argv[1], sys.argv[2])
    """
)


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """The launcher in its own session, stderr to a file, TMPDIR inside the test's folder; a
    script, so its interpreter starts warm (tests/cli.py)."""
    notes = tmp_path / "pids"
    notes.mkdir()
    (tmp_path / "tmp").mkdir()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    with open(tmp_path / "stderr", "w") as err:
        process = cli.Popen(
            [sys.executable, str(script), str(notes), mode],
            cwd=REPO,
            env=environment,
            stderr=err,
            start_new_session=True,
        )
    return process, notes


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rank_pids(process: subprocess.Popen, notes: Path) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while len(list(notes.glob("*.pid"))) < 2:
        assert process.poll() is None, "the launcher ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # let the pid files' writes finish
    return [int((notes / f"{rank}.pid").read_text()) for rank in range(2)]


def stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    process, notes = start(tmp_path, "loop")
    try:
        ranks = rank_pids(process, notes)
        os.kill(process.pid, signal.SIGKILL)  # the launcher only, not its session
        process.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if alive(pid)], "ranks outlived their launcher"
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        stop_group(process)


def test_a_stopped_rank_is_named_as_the_stuck_one(tmp_path):
    process, notes = start(tmp_path, "loop")
    try:
        ranks = rank_pids(process, notes)
        os.kill(ranks[1], signal.SIGSTOP)
        assert process.wait(timeout=GONE_WITHIN_S * 2) == 1
    finally:
        stop_group(process)
    last = (tmp_path / "stderr").read_text().strip().splitlines()[-1]
    assert last.startswith(
        f"error: rank 1 failed: stopped by SIGSTOP (pid {ranks[1]}), so its peers waited"
    ), last
    assert not alive(ranks[1])
    assert (
        list((tmp_path / "tmp").iterdir()) == []
    )  # neither torchelastic_* nor the watch's folder is left


def test_the_error_line_starts_its_own_line_after_a_progress_bar(tmp_path):
    process, _ = start(tmp_path, "bar")
    try:
        assert process.wait(timeout=GONE_WITHIN_S * 2) == 1
    finally:
        stop_group(process)
    text = (tmp_path / "stderr").read_text()
    assert "\nerror: rank 1 failed: ValueError: injected\n" in text.replace("\ntraceback", "\n"), (
        text[-2000:]
    )
    assert "4/10 [00:01<00:01]\n" in text  # the bar's line was ended before the report
    assert list((tmp_path / "tmp").iterdir()) == []


def test_bad_input_prints_one_line_from_rank_zero(tmp_path):
    process, _ = start(tmp_path, "bad_input")
    try:
        assert process.wait(timeout=GONE_WITHIN_S * 2) == 1
    finally:
        stop_group(process)
    lines = (tmp_path / "stderr").read_text().strip().splitlines()
    assert lines == ["error: train.seq_len=0 must be positive"], lines


def test_fail_once_is_one_line_from_the_launcher_whatever_the_ranks_ended_with(capsys):
    """The ranks leave fail_once's line to the launcher: said once, the lowest rank's, even when
    rank 0 lost a peer that had left first; a rank that failed otherwise is still named."""
    said = RankExit(rank=1, error="ReportedExit: 1", time=2.0, reported=True, message="bad key")
    lost = RankExit(rank=0, error="RuntimeError: Connection closed by peer", time=1.0)
    also = RankExit(rank=0, error="ReportedExit: 1", time=1.0, reported=True, message="bad key")
    for failures in ([lost, said], [said, also]):
        with pytest.raises(SystemExit) as exit_:
            _report_failure(failures)
        assert exit_.value.code == 1
        assert capsys.readouterr().err == "error: bad key\n"
    crashed = RankExit(rank=2, error="ValueError: broken", time=3.0, traceback="tb")
    with pytest.raises(SystemExit):
        _report_failure([lost, said, crashed])
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 1 failed: bad key (then rank 2: ValueError: broken)"
    ]
