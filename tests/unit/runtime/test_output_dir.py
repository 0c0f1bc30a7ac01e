"""A run owns its output_dir: the lock (a second run is refused, naming the holder), run.json,
refusing a fresh run into another run's folder, overwrite removing only our files, and hf/ keeping
the user's files."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from components.checkpoint.dcp import publish_folder
from components.checkpoint.manifest import foreign_files
from components.paths import unused_name
from components.processes import process_alive
from components.runtime.output_dir import (
    RUN_FILE,
    OutputDirError,
    OutputDirLock,
    claim_output_dir,
    config_hash,
    read_run_record,
    run_output_folder,
)

REPO = Path(__file__).resolve().parents[3]
HOLD_LOCK = """
import sys, time
from components.runtime.output_dir import lock_output_dir
lock_output_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "run")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            OutputDirError,
            match=rf"^output_dir {tmp_path / 'run'} is in use by another run \(pid "
            rf"{holder.pid} on {os.uname().nodename}, started .*\); wait for it",
        ):
            OutputDirLock(tmp_path / "run").acquire()
    finally:
        holder.kill()
        holder.wait()
    with OutputDirLock(tmp_path / "run") as lock:  # the holder died: the kernel released its lock
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    with OutputDirLock(tmp_path / "run"):  # released on exit, so taken again
        pass


# A launcher that takes the lock, forks a rank (which inherits it, as the recipe's forked ranks
# do) that lingers for argv[2] seconds, and ends at once: a killed run whose rank is still exiting.
LINGERING_RANK = """
import os, sys, time
from components.runtime.output_dir import lock_output_dir
lock_output_dir(sys.argv[1])
rank = os.fork()
if rank == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print(rank, flush=True)
"""


def launcher_with_a_lingering_rank(folder: Path, linger_s: float) -> tuple[int, int]:
    """(the ended launcher's pid, its rank's pid, still alive and holding the lock)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LINGERING_RANK, str(folder), str(linger_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    rank = int(launcher.stdout.readline())
    assert launcher.wait() == 0
    assert process_alive(rank)
    return launcher.pid, rank


def test_a_lock_whose_launcher_ended_is_taken_once_its_ranks_exit(tmp_path):
    launcher, rank = launcher_with_a_lingering_rank(tmp_path / "run", linger_s=1.0)
    with OutputDirLock(tmp_path / "run") as lock:  # refused at once before: "in use by another run"
        assert not process_alive(rank)
        assert json.loads(lock.path.read_text())["pid"] == os.getpid() != launcher


def test_a_lock_held_on_after_its_launcher_ended_is_refused_naming_it(tmp_path):
    launcher, rank = launcher_with_a_lingering_rank(tmp_path / "run", linger_s=120.0)
    try:
        with pytest.raises(
            OutputDirError,
            match=rf"^output_dir {tmp_path / 'run'} is still held by processes of a run whose "
            rf"launcher \(pid {launcher} on {os.uname().nodename}, started .*\) has ended",
        ):
            OutputDirLock(tmp_path / "run", ended_holder_wait_s=0.2).acquire()
    finally:
        os.kill(rank, signal.SIGKILL)


def fill_with_a_run(folder: Path) -> None:
    """What a finished run leaves: metrics, plot, checkpoints, an export (published, so with its
    manifest)."""
    claim_output_dir(folder, "hash-a", continuing=False, overwrite=False, resumable=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "loss.png").write_bytes(b"png")
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    staging = folder / "hf.tmp"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    publish_folder(staging, folder / "hf")


def test_a_fresh_run_into_another_runs_folder_is_refused_with_the_choices(tmp_path):
    fill_with_a_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    first = read_run_record(tmp_path)
    message = (
        rf"^output_dir {tmp_path} holds another run's files "
        r"\(metrics.jsonl, loss.png, checkpoints, hf, run.json\); "
        r"to continue that run set checkpoint.resume=auto, "
        r"to keep it choose another output_dir=\.\.\., "
        r"to replace it set overwrite_output_dir=true$"
    )
    with pytest.raises(OutputDirError, match=message):
        claim_output_dir(tmp_path, "hash-b", continuing=False, overwrite=False, resumable=True)
    nothing_to_resume = (
        rf"^output_dir {tmp_path} holds another run's files \(.*\) "
        r"and no complete checkpoint to resume from; "
        r"to keep it choose another output_dir=\.\.\., to replace it set overwrite_output_dir=true$"
    )
    with pytest.raises(OutputDirError, match=nothing_to_resume):
        claim_output_dir(tmp_path, "hash-b", continuing=False, overwrite=False, resumable=False)
    assert read_run_record(tmp_path) == first  # nothing changed

    resumed = claim_output_dir(
        tmp_path, "hash-b", continuing=True, overwrite=False, resumable=False
    )
    assert (
        resumed.run_id == first.run_id and resumed.config_hash == "hash-b"
    )  # the same run goes on
    assert (tmp_path / "metrics.jsonl").exists()

    fresh = claim_output_dir(tmp_path, "hash-c", continuing=False, overwrite=True, resumable=True)
    assert fresh.run_id != first.run_id
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "notes.txt",
        RUN_FILE,
    ]  # the user's file stays


def test_an_empty_or_user_only_folder_is_claimed_and_run_json_records_the_run(tmp_path):
    (tmp_path / "readme.md").write_text("my notes")
    record = claim_output_dir(
        tmp_path,
        config_hash({"tp": 2, "seed": 0}),
        continuing=False,
        overwrite=False,
        resumable=True,
    )
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == record.run_id
    assert (
        config_hash({"seed": 0, "tp": 2}) == record.config_hash != config_hash({"tp": 4, "seed": 0})
    )


def test_user_files_inside_hf_are_never_deleted(tmp_path):
    fill_with_a_run(tmp_path)
    (tmp_path / "hf" / "my_eval.txt").write_text("results")
    for continuing, overwrite in ((False, True), (True, False)):
        with pytest.raises(
            OutputDirError,
            match=r"shardtune did not write inside its own folders \(hf/my_eval.txt\)",
        ):
            claim_output_dir(
                tmp_path,
                "hash-b",
                continuing=continuing,
                overwrite=overwrite,
                resumable=not continuing,
            )
    assert foreign_files(tmp_path / "hf") == ["my_eval.txt"]
    staging = tmp_path / "hf.tmp"
    staging.mkdir()
    (staging / "config.json").write_text('{"new": true}')
    with pytest.raises(
        FileExistsError, match=r"hf holds files shardtune did not write \(my_eval.txt\)"
    ):
        publish_folder(
            staging, tmp_path / "hf"
        )  # the export refuses instead of replacing the folder
    assert (tmp_path / "hf" / "my_eval.txt").read_text() == "results"
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"


def test_a_folder_without_a_manifest_is_the_users(tmp_path):
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "notes.txt"):
        (tmp_path / "hf" / name).write_text("x")
    assert foreign_files(tmp_path / "hf") == ["config.json", "notes.txt"]
    assert foreign_files(tmp_path / "missing") == []


def test_a_per_run_folder_taken_in_the_same_second_gets_the_next_number(tmp_path):
    first = tmp_path / "2026-12-01_23-05-48"
    assert unused_name(first) == first
    first.mkdir()
    assert unused_name(first) == tmp_path / "2026-12-01_23-05-48_2"
    (tmp_path / "2026-12-01_23-05-48_2").mkdir()
    assert unused_name(first) == tmp_path / "2026-12-01_23-05-48_3"


def test_the_run_folder_is_the_sweep_jobs_else_the_configured_one_numbered_per_run(tmp_path):
    per_run, fixed = "outputs/${now:%Y-%m-%d_%H-%M-%S}", "outputs/mine"
    taken = tmp_path / "2026-12-01_23-05-48"
    taken.mkdir()
    assert run_output_folder(str(taken), per_run, None) == (tmp_path / f"{taken.name}_2", True)
    assert run_output_folder(str(taken), fixed, None) == (taken, False)  # resumed or refused
    job = str(tmp_path / "sweep" / "0")
    assert run_output_folder(str(taken), per_run, job) == (Path(job), True)


def test_a_released_lock_leaves_no_lock_file(tmp_path):
    with OutputDirLock(tmp_path / "run") as lock:
        assert lock.path.is_file()
    assert not lock.path.exists()
    stale = tmp_path / "run" / ".lock"  # what a SIGKILLed holder leaves: its pid, long gone
    stale.write_text(json.dumps({"pid": 999999999, "host": "h", "started": "then"}))
    with OutputDirLock(tmp_path / "run") as lock:  # taken over, then removed with this release
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not stale.exists()
