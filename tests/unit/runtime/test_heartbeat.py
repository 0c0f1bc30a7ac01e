"""Heartbeats: a watched rank idle past the timeout, or a rank whose beat file stopped changing, is
a hang naming the rank that holds the others up; a phase judged on its beat alone never is, however
long. Beat files are written by hand and the watcher's clock is a counter: no test waits."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from components.runtime.heartbeat import Beat, HangWatch, Heartbeat, beat_interval

TIMEOUT = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(folder, rank: int, seq: int, **fields) -> None:
    beat = dict(rank=rank, pid=os.getpid(), seq=seq, marks=7, what="step 4", idle_s=0.0)
    beat |= dict(watched=True) | fields
    (folder / f"{rank}.0.beat").write_text(json.dumps(beat))


def test_a_busy_world_is_no_hang_and_a_long_unwatched_phase_is_none_either(tmp_path):
    clock = Clock()
    clock = Clock()
    watch = HangWatch(tmp_path, TIMEOUT, clock)
    for seq in range(1, 30):  # 29 looks, one interval apart: the beats keep changing
        write(tmp_path, 0, seq, idle_s=0.5)
        write(tmp_path, 1, seq, what="saving step 4", idle_s=300.0, watched=False)
        assert watch.look("0") is None
        clock.now += watch.interval


def test_a_rank_whose_beat_stopped_is_named_over_the_one_waiting_for_it(tmp_path):
    clock = Clock()
    watch = HangWatch(tmp_path, TIMEOUT, clock)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        write(tmp_path, 1, 5, pid=stopped.pid, marks=6)  # silent from now on
        for seq in range(1, 20):
            waiting = dict(idle_s=seq * watch.interval, waiting_in="all_reduce", collective=True)
            write(tmp_path, 0, seq, **waiting)
            age = time.time() - (clock.now - 1000)  # rank 1's file: as old as the watch
            os.utime(tmp_path / "1.0.beat", (age, age))
            if (hang := watch.look("0")) is not None:
                break
            clock.now += watch.interval
    finally:
        stopped.kill()
        stopped.wait()
    assert (hang.rank, hang.silent, hang.pids) == (1, [1], {0: os.getpid(), 1: stopped.pid})
    assert hang.text == (
        "made no progress for 10 s (hang_timeout_s=10), at step 4: its process is stopped "
        f"(pid {stopped.pid}); rank 0 at step 4, waiting in all_reduce"
    )


def test_the_rank_behind_is_named_when_every_rank_is_idle(tmp_path):
    clock = Clock()
    clock = Clock()
    watch = HangWatch(tmp_path, TIMEOUT, clock)
    write(tmp_path, 0, 1, idle_s=11.0, waiting_in="all_reduce", collective=True, marks=9)
    write(tmp_path, 1, 1, idle_s=11.0, waiting_in="forward (model.py:3)", what="step 3", marks=8)
    hang = watch.look("0")
    assert hang.rank == 1 and hang.silent == []
    assert hang.text.startswith("made no progress for 11 s (hang_timeout_s=10), at step 3, ")
    assert "waiting in forward (model.py:3); rank 0 at step 4, waiting in all_reduce" in hang.text


def test_beats_of_other_attempts_and_ended_ranks_are_not_read(tmp_path):
    clock = Clock()
    clock = Clock()
    watch = HangWatch(tmp_path, TIMEOUT, clock)
    write(tmp_path, 0, 1, idle_s=500.0)  # attempt 0's
    assert watch.look("1") is None
    assert watch.look("0", pids={0: os.getpid() + 1}) is None  # rank 0 now runs as another pid
    assert watch.look("0", pids={}) is None  # rank 0 ended
    assert watch.look("0").rank == 0


def test_a_heartbeat_marks_progress_and_is_judged_only_while_watched(tmp_path):
    path = tmp_path / "3.0.beat"
    heart = Heartbeat(path, 3, TIMEOUT)
    assert heart.beat().what == "setting up" and not Beat.read(path).watched
    with heart.watched("step 2", judged=False):
        assert not Beat.read(path).watched  # the first step: it may compile for minutes
    with heart.watched("step 3"):
        heart.progress("step 3, micro-batch 2")
        written = Beat.read(path)  # at the stretch's start: what a rank stopped there was doing
        assert (written.what, written.watched, written.marks) == ("step 3", True, 3)
        beat = heart.beat()
        assert (beat.what, beat.marks, beat.seq) == ("step 3, micro-batch 2", 4, 4)
    assert (heart.beat().what, heart.beat().watched) == ("after step 3", False)
    heart.start(peers=None)
    heart.stop()
    assert not path.exists()  # a rank that is done is not watched


def test_the_beat_interval_is_an_eighth_of_the_timeout_within_bounds():
    assert [beat_interval(t) for t in (2, 10, 120, 600)] == [0.25, 1.25, 5.0, 5.0]


# A function "in" torch's files, as a collective's wait and torch elastic's outer wrapper are.
TORCH_FILE = f"{os.sep}site-packages{os.sep}torch{os.sep}distributed{os.sep}fake.py"
FAKE_TORCH = compile("def all_reduce(wait, *args):\n    wait(*args)\n", TORCH_FILE, "exec")


def idle_beat(tmp_path, wait_in, *args) -> Beat:
    """The beat taken while the main thread runs ``wait_in(*args)``, past half the timeout."""
    heart, beats = Heartbeat(tmp_path / "0.0.beat", 0, 2.0), []
    with heart.watched("step 5"):
        beating = threading.Timer(1.1, lambda: beats.append(heart.beat()))
        beating.start()
        wait_in(*args)
        beating.join()
    return beats[0]


def test_an_idle_rank_says_where_it_waits_in_a_collective_or_in_its_own_code(tmp_path):
    torch_functions: dict = {}
    exec(FAKE_TORCH, torch_functions)
    all_reduce = torch_functions["all_reduce"]
    collective = idle_beat(tmp_path, all_reduce, time.sleep, 1.3)  # C code under a torch frame
    assert (collective.waiting_in, collective.collective) == ("all_reduce", True)
    # user code that a torch.distributed frame further out runs (torch elastic's record wrapper)
    user = idle_beat(tmp_path, all_reduce, sleep_in, 1.3)
    assert user.waiting_in.startswith("sleep_in (test_heartbeat.py:")
    assert not user.collective
    assert "time.sleep(seconds)" in user.stack and ", in all_reduce" in user.stack


def sleep_in(seconds: float) -> None:
    time.sleep(seconds)
