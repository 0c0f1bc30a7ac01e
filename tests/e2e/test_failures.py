"""Failures mid-run: a rank that dies stops the whole run quickly with one clear ``error:`` line,
and a run killed in the middle of a checkpoint save resumes from the previous checkpoint,
reproducing the losses.

The recipe runs as a user starts it (``python recipes/finetune.py ...``) in its own session, so a
test can SIGKILL one rank (a child of the recipe process) or the whole process group.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from components.checkpoint.integrity import MARKER
from components.runtime.launch import RankExit, describe_rank_failure, free_port
from tests import cli
from tests.harness import tiny_model_folder

REPO = Path(__file__).resolve().parents[2]
# Small and quick: tp=2, 4 sequences per step in 2 micro-batches, no validation or export.
COMMON = [
    "tp=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=400",
]
# How long the survivors and the launcher may take to stop after a rank dies.
STOP_WITHIN_S = 60


def start_recipe(
    output_dir: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    launcher: tuple[str, ...] = (),
    piped: bool = False,
) -> subprocess.Popen:
    """Start the recipe in its own session (process group), its output in files beside
    ``output_dir``; ``launcher``: ``python -m`` arguments that start it (torchrun's); ``piped``:
    its stdout and stderr are pipes (``| tee``, a Slurm step), copied into those files."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # TMPDIR: what a killed launcher leaves in temporary folders (torch elastic's logs, the rank
    # watch's notes) stays under the test's own folder.
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(output_dir.parent),
        **(env or {}),
    }
    if launcher:  # torchrun's workers start warm (tests/cli.py)
        environment = cli.warm_torchrun_environment(environment)
    command = [
        sys.executable,
        *launcher,
        "recipes/finetune.py",
        *COMMON,
        f"output_dir={output_dir}",
        *overrides,
    ]
    if piped:  # a thread empties each pipe: nothing blocks on a full one
        paths = (output_dir.with_suffix(".out"), output_dir.with_suffix(".err"))
        return cli.PipedProcess(command, paths, cwd=REPO, env=environment, start_new_session=True)
    # Files: nothing blocks on a full pipe. The child keeps its own copies of the descriptors.
    with (
        open(output_dir.with_suffix(".out"), "w") as out,
        open(output_dir.with_suffix(".err"), "w") as err,
    ):
        return cli.Popen(
            command, cwd=REPO, env=environment, stdout=out, stderr=err, start_new_session=True
        )


def stderr_of(output_dir: Path) -> str:
    return output_dir.with_suffix(".err").read_text()


def assert_said_on_lines_of_their_own(output: bytes, *expected: str) -> None:
    """Each ``error:``, ``note:`` and ``warning:`` in a run's ``output`` (its bytes as written)
    starts a line, so ``grep '^error:'`` finds it: none is glued to a progress bar's partial line
    (``... 3/100 [...]error: ...``); and each of ``expected`` starts one of them."""
    text = output.decode(errors="replace")
    said = list(re.finditer(r"(?<![\w-])(error|note|warning): ", text))
    for found in said:
        start = found.start()
        assert start == 0 or text[start - 1] == "\n", repr(text[max(0, start - 160) : start + 80])
    lines = [text[found.start() : text.find("\n", found.start())] for found in said]
    for line in expected:
        assert any(said.startswith(line) for said in lines), (line, lines)


def run_recipe(output_dir: Path, *overrides: str) -> None:
    process = start_recipe(output_dir, *overrides)
    assert process.wait(timeout=300) == 0, stderr_of(output_dir)[-3000:]


def metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and all it started (its session), unless it has ended."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for(condition, timeout: float, process: subprocess.Popen, what: str) -> None:
    """Poll ``condition`` every 20 ms; fail if the process ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the recipe exited ({process.returncode}) before {what}")
        if time.monotonic() > deadline:
            kill_group(process)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (from every thread's /proc children list)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(child) for child in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return sorted(found)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_rank_stops_the_run_and_is_named(tmp_path):
    output_dir = tmp_path / "run"
    process = start_recipe(output_dir, "train.max_steps=1000")
    try:
        # The launcher forks one process per rank; both are training once two steps are logged.
        wait_for(
            lambda: len(metrics(output_dir)) >= 2 and len(children(process.pid)) == 2,
            120,
            process,
            "step 2",
        )
        ranks = children(process.pid)
        victim = ranks[-1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = process.wait(timeout=STOP_WITHIN_S)
        stopped_after = time.monotonic() - killed_at
    finally:
        kill_group(process)
    print(f"recipe exited {stopped_after:.1f} s after the kill")
    assert returncode != 0
    assert stopped_after < STOP_WITHIN_S
    assert not any(alive(pid) for pid in ranks), "a rank outlived the launcher"
    last = stderr_of(output_dir).strip().splitlines()[-1]
    assert re.match(rf"error: rank [01] failed: killed by SIGKILL \(pid {victim}\)", last), last
    assert len(metrics(output_dir)) < 1000


def test_a_rank_that_raises_mid_run_stops_the_recipe_and_is_named(tmp_path):
    """Through pipes (``| tee``), the launcher's lines start lines of their own."""
    output_dir = tmp_path / "run"
    process = start_recipe(output_dir, "train.max_steps=1000", "debug.fault=raise@3", piped=True)
    try:
        returncode = process.wait(timeout=120)
    finally:
        kill_group(process)
    assert returncode != 0
    last = stderr_of(output_dir).strip().splitlines()[-1]
    line = "error: rank 1 failed: RuntimeError: injected fault (debug.fault=raise@3)"
    assert last == line, last
    errors = output_dir.with_suffix(".err").read_bytes()
    assert_said_on_lines_of_their_own(errors, line)
    assert_said_on_lines_of_their_own(output_dir.with_suffix(".out").read_bytes())  # stdout's too
    assert b"\ntraceback of the failed rank:\n" in errors
    assert [r["step"] for r in metrics(output_dir)] == [1, 2]
    # The corrected rerun (no fault) into the same folder, with the choice the folder's refusal
    # names for a run without a checkpoint: it replaces the failed run's files and trains.
    rerun = start_recipe(output_dir, "train.max_steps=3", "overwrite_output_dir=true")
    assert rerun.wait(timeout=150) == 0, stderr_of(output_dir)[-3000:]
    assert [r["step"] for r in metrics(output_dir)] == [1, 2, 3]


def torchrun() -> tuple[str, ...]:
    """``python -m`` arguments of torchrun with 2 local ranks on a fresh port."""
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    return ("-m", "torch.distributed.run", "--nproc_per_node=2", *rendezvous)


# The last rank SIGSTOPs itself at step 4 (step 2 saved); its heartbeat stops, rank 0 waits in a
# collective.
HANG = ["train.max_steps=1000", "checkpoint.every_steps=2", "hang_timeout_s=6"]
HANG += ["debug.fault=stop@4"]
HANG_LINE = (
    r"error: rank 1 made no progress for \d+ s \(hang_timeout_s=6\), at step 4: its process is "
    r"stopped \(pid (\d+)\); rank 0 at step 4, micro-batch 1, waiting in \w+"
)


@pytest.mark.parametrize("launcher", ["recipe", "torchrun"])
def test_a_stopped_rank_is_found_by_its_heartbeat_and_every_rank_ends(tmp_path, launcher):
    output_dir = tmp_path / "run"
    started = start_recipe(  # through pipes (``| tee``): the line starts a line of its own
        output_dir, *HANG, launcher=torchrun() if launcher == "torchrun" else (), piped=True
    )
    try:
        returncode = started.wait(timeout=150)  # the collective timeout is 10 minutes
    finally:
        kill_group(started)
    assert returncode == 1
    errors = [line for line in stderr_of(output_dir).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and (found := re.fullmatch(HANG_LINE, errors[0])), errors
    assert_said_on_lines_of_their_own(output_dir.with_suffix(".err").read_bytes(), errors[0])
    assert_said_on_lines_of_their_own(output_dir.with_suffix(".out").read_bytes())  # stdout's too
    assert not alive(int(found.group(1)))  # the stopped rank was killed, not left behind
    assert [record["step"] for record in metrics(output_dir)] == [1, 2, 3]
    if launcher == "recipe":  # the rerun without the fault continues in the same folder
        rerun = start_recipe(output_dir, *HANG[:-1], "checkpoint.resume=auto", "train.stop_after=4")
        assert rerun.wait(timeout=150) == 0, stderr_of(output_dir)[-3000:]
        assert [record["step"] for record in metrics(output_dir)] == [1, 2, 3, 4]
        assert "resumed from" in output_dir.with_suffix(".out").read_text()


# The launcher's report of a rank that raises, driven directly: launch_local on 2 ranks, rank 1
# raising at its fourth step while rank 0 keeps stepping.
RAISING_RANKS = textwrap.dedent(
    """
    import time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from components.runtime.launch import launch_local
    from components.runtime.world import init_process_group

    def work():
        init_process_group("gloo", timedelta(minutes=5))
        for step in range(10_000):
            dist.all_reduce(torch.ones(1))
            if step == 3 and dist.get_rank() == 1:
                raise ValueError("injected failure at step 4")
            time.sleep(0.01)

    launch_local(work, 2)
    """
)


def test_a_rank_that_raises_is_named_with_its_error_and_traceback(tmp_path):
    # a script in the recipe runs' environment: it starts from their warm interpreter (tests/cli.py)
    script = tmp_path / "ranks.py"
    script.write_text(RAISING_RANKS)
    started = time.monotonic()
    result = cli.run(
        [sys.executable, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=STOP_WITHIN_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    print(f"launch with a raising rank ended in {time.monotonic() - started:.1f} s")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "error: rank 1 failed: ValueError: injected failure at step 4", (
        result.stderr
    )
    assert (
        f'File "{script}", line 14, in work' in result.stderr
    )  # the rank's traceback, above the line
    assert (
        "ChildFailedError" not in result.stderr and "=====" not in result.stderr
    )  # not torch's report


def test_the_rank_that_died_is_named_before_peers_that_lost_it():
    failures = [
        RankExit(
            rank=0,
            error="RuntimeError: [gloo] Read error [127.0.0.1]:1234: Connection reset by peer",
            time=10.01,
            traceback="tb 0",
        ),
        # seen by the watch's poll after rank 0's error
        RankExit(rank=1, error="killed by SIGKILL (pid 101)", time=10.02),
        # stopped by the launcher
        RankExit(
            rank=2, error="SignalException: Process 102 got signal: 15", time=10.2, traceback="tb 2"
        ),
    ]
    assert describe_rank_failure(failures) == (
        "error: rank 1 failed: killed by SIGKILL (pid 101)",
        None,
    )
    # failed on its own, later
    failures.append(
        RankExit(rank=3, error="ValueError: [/src/x.cc:12] bad", time=10.5, traceback="tb 3")
    )
    line = "error: rank 1 failed: killed by SIGKILL (pid 101) (then rank 3: ValueError: bad)"
    assert describe_rank_failure(failures) == (line, None)
    assert describe_rank_failure([failures[0], failures[3]]) == (
        "error: rank 3 failed: ValueError: bad",
        "tb 3",
    )
    both = [
        RankExit(rank=1, error="RuntimeError: same", time=3.0, traceback="tb 1"),
        RankExit(rank=0, error="RuntimeError: same", time=3.1, traceback="tb 0"),
    ]
    assert describe_rank_failure(both) == (
        "error: rank 1 failed: RuntimeError: same (so did rank 0)",
        "tb 1",
    )
    # a hang the launcher found (its text names a timeout) is no peer's consequence
    hung = "made no progress for 12 s (hang_timeout_s=10), at step 4"
    hang = RankExit(rank=2, error=hung, time=10.3, traceback="stack 2", hang=True)
    assert describe_rank_failure([failures[0], hang]) == (f"error: rank 2 {hung}", "stack 2")
    # the ranks the launcher SIGKILLed on that hang are its consequences, even when torch elastic
    # reaped one first and its record's time (whole seconds) reads earlier than the hang's
    killed = "killed by SIGKILL (pid 9) after rank 2 hung"
    ended = RankExit(rank=0, error=killed, time=10, ended=True)
    assert describe_rank_failure([ended, hang]) == (f"error: rank 2 {hung}", "stack 2")


def test_a_kill_during_a_checkpoint_save_resumes_from_the_previous_one(tmp_path):
    steps = ["train.max_steps=6", "checkpoint.every_steps=2"]
    interrupted = tmp_path / "interrupted"
    checkpoints = interrupted / "checkpoints"
    saving = checkpoints / "step_00000004.tmp"
    process = start_recipe(interrupted, *steps, "debug.fault=slow_save@3")
    try:
        # Every rank is writing (or has written) step 4's files; the save waits 3 s before its
        # marker and rename.
        wait_for(
            lambda: (saving / "trainer_state.json").is_file(),
            240,
            process,
            "step 4's checkpoint files",
        )
        kill_group(process)
        assert (checkpoints / "step_00000002" / MARKER).is_file()
        assert saving.is_dir() and not (saving / MARKER).exists()
        assert not (checkpoints / "step_00000004").exists()
        # the run's own steps 3 and 4, uninterrupted until the kill in step 4's save: the
        # reference for the resumed run's (a save changes no result)
        uninterrupted = metrics(interrupted)
        assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4]

        run_recipe(interrupted, *steps, "checkpoint.resume=auto")
    finally:
        kill_group(process)
    assert (
        f"resumed from {checkpoints / 'step_00000002'} at step 2"
        in interrupted.with_suffix(".out").read_text()
    )
    records = metrics(interrupted)
    # The killed run's lines after the checkpoint (steps 3 and 4) were dropped when the run resumed.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # Exact on the CPU: step 3 from step 2's weights, step 4 after an update from its optimizer
    # state and lr; both as the killed run trained them before the kill.
    for name in ("loss", "grad_norm", "lr"):
        assert [r[name] for r in records[2:4]] == [r[name] for r in uninterrupted[2:4]], name
    assert (checkpoints / "step_00000004" / MARKER).is_file() and not saving.exists()


def test_a_launcher_killed_while_it_tokenizes_leaves_no_process_and_no_scratch(tmp_path):
    # a model folder's tokenizer (none trained on the data), and records enough for 2 map workers
    # with 2 batches of 20,000 each
    model = ["model=pretrained", f"model.pretrained_path={tiny_model_folder(tmp_path)}"]
    cache, output = tmp_path / "cache", tmp_path / "killed"
    shared = [*model, f"cache_dir={cache}", "tp=1", "train.max_steps=1", "train.warmup_steps=1"]
    process = start_recipe(output, *shared, "data.num_examples=80000")
    workers: list[int] = []
    try:
        # the workers are forked (each dies with the launcher from its fork on) and at work
        wait_for(lambda: tokenizing(process, cache, workers), 600, process, "the map workers")
        scratch = next(cache.glob("data/*.tmp-*"))
        for pid in workers:  # frozen: now only the kernel's parent-death signal can end them
            os.kill(pid, signal.SIGSTOP)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + STOP_WITHIN_S
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in workers if alive(pid)], "map workers outlived the launcher"
    finally:
        kill_group(process)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert scratch.is_dir()  # a SIGKILL runs no clean-up: the next preparation in the cache does
    rerun = start_recipe(tmp_path / "next", *shared, "data.num_examples=200")
    assert rerun.wait(timeout=300) == 0, stderr_of(tmp_path / "next")[-3000:]
    assert not scratch.exists() and not list(cache.glob("data/*.tmp-*"))


def tokenizing(process: subprocess.Popen, cache: Path, workers: list[int]) -> bool:
    """Whether the launcher's map workers (its forks, listed into ``workers``) are at work."""
    if process.poll() is not None:
        return False  # wait_for says it ended
    launcher = _cmdline(process.pid)
    workers[:] = [pid for pid in children(process.pid) if _cmdline(pid) == launcher]
    return len(workers) >= 2 and bool(list(cache.glob("data/*.tmp-*/tokens/*")))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def test_the_rank_folder_of_a_sigkilled_launcher_is_removed_by_the_next_launch(tmp_path):
    first = start_recipe(tmp_path / "killed", "train.max_steps=100000")
    try:
        wait_for(lambda: bool(metrics(tmp_path / "killed")), 300, first, "the first step")
        left = [path for path in tmp_path.glob("shardtune-ranks-*") if path.is_dir()]
        assert [path.name.split("-")[2] for path in left] == [str(first.pid)]
    finally:
        kill_group(first)  # SIGKILL: no clean-up runs
    assert left[0].is_dir()
    run_recipe(tmp_path / "next", "train.max_steps=1", "train.warmup_steps=1")
    assert not list(tmp_path.glob("shardtune-ranks-*"))


def test_a_run_killed_before_its_first_checkpoint_starts_again_under_resume_auto(tmp_path):
    """kill -9 of the launcher at step 3, before the first checkpoint: the same command with
    checkpoint.resume=auto (a requeued job's) starts again from step 0, saying so, and trains the
    whole run as the killed attempt began it; a run of another config is refused as before and
    changes nothing."""
    folder, same = tmp_path / "killed", ("train.max_steps=12", "checkpoint.every_steps=10")
    same += ("checkpoint.resume=auto",)
    first = start_recipe(folder, *same)
    try:
        wait_for(lambda: len(metrics(folder)) >= 3, 300, first, "step 3")
        os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its ranks die with it
        first.wait()
    finally:
        kill_group(first)
    killed = metrics(folder)
    assert 3 <= len(killed) < 10 and not list(folder.glob("checkpoints/step_*"))
    other = start_recipe(folder, *same, "optim.lr=0.001")
    assert other.wait(timeout=300) == 2
    assert (
        f"error: output_dir {folder} holds another run's files (metrics.jsonl, config.yaml, "
        in (stderr_of(folder))
    )
    assert metrics(folder) == killed
    again = start_recipe(folder, *same)
    assert again.wait(timeout=300) == 0, stderr_of(folder)[-3000:]
    assert (
        f"note: checkpoint.resume=auto: {folder} holds an earlier attempt of this run (its "
        "run.json records the same config) that stopped before its first checkpoint: starting "
        "again from step 0, its files (metrics.jsonl, config.yaml, run.json) replaced"
    ) in folder.with_suffix(".out").read_text()
    records = metrics(folder)
    assert [record["step"] for record in records] == list(range(1, 13))
    for before, after in zip(killed, records, strict=False):  # the same start, from step 0
        assert abs(before["loss"] - after["loss"]) <= 1e-5 * before["loss"]
    saved = sorted(path.name for path in (folder / "checkpoints").iterdir())
    assert saved == ["step_00000010", "step_00000012"]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (mounting needs root: skipped where it cannot be mounted)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_is_named_on_the_error_line_and_the_last_checkpoint_survives(small_disk):
    # two 2 MiB checkpoints do not fit in 3 MiB: the second save fails, torch saying only
    # "unexpected pos"
    output = small_disk / "run"
    every = ["train.val_every=0", "checkpoint.every_steps=2", f"output_dir={output}"]
    result = full_disk_run(*every, "train.max_steps=4")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert f"no space left on device in {output}" in last, last
    assert "the last complete checkpoint, step_00000002, is kept" in last, last
    assert (output / "checkpoints" / "step_00000002" / MARKER).is_file()

    # resuming on the still-full disk: one line before any rank starts, nothing of it left behind
    again = full_disk_run(*every, "train.max_steps=4", "checkpoint.resume=auto")
    assert again.returncode != 0 and again.stderr.strip().splitlines() == [
        f"error: no space left on device in {output} (0.0 MiB free): the last complete "
        "checkpoint, step_00000002, is kept: free space and checkpoint.resume=auto continues from "
        "it, or choose an output_dir on another disk"
    ], again.stderr[-3000:]
    assert not list(output.glob(".run.json.*")) and not (output / ".lock").exists()

    # room for step 4's checkpoint but not for the export: it says how to go on from there
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    checkpoints = output / "checkpoints"  # the next save removes the failed one's .tmp first
    room = size_of(checkpoints / "step_00000002") - size_of(checkpoints / "step_00000004.tmp")
    filler = small_disk / "filler"
    filler.write_bytes(bytes(shutil.disk_usage(small_disk).free - room - 200 * 2**10))
    exported = full_disk_run(*every, "train.max_steps=4", "checkpoint.resume=auto")
    last = exported.stderr.strip().splitlines()[-1]
    assert "resumed from" in exported.stdout and "step_00000004, is of the run's last step" in last
    assert "checkpoint.resume=auto with a train.max_steps above 4 trains on from it" in last, last
    filler.unlink()
    done = full_disk_run(*every, "train.max_steps=5", "checkpoint.resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (output / "hf" / "config.json").is_file()


def size_of(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def full_disk_run(*overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "recipes/finetune.py", *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # the module's other runs' zygote
    return cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment)
