"""When a local rank fails, its launcher notes it in the ranks' folder, and every other rank's peer
watch aborts its communicators and ends the rank: on NCCL a survivor would otherwise wait inside a
CUDA sync, where no signal reaches it, until torch elastic SIGKILLs it. A note for an earlier
attempt (before a restart) does not count."""

import json
import multiprocessing
import os
import time
from pathlib import Path

from components.runtime import launch, world


def _survivor(folder: str) -> None:
    """A rank blocked for good (as in a NCCL wait), with its peer watch on."""
    os.environ.update(launch_environment(folder))
    world._ABORT_GRACE_S = 0.2  # this rank's main thread never unwinds: no need to wait 5 s
    world.abort_when_a_peer_fails(abort=lambda: open(os.path.join(folder, "aborted"), "w").close())
    (Path(folder) / "watching").write_text("")
    time.sleep(600)


def launch_environment(folder: str) -> dict[str, str]:
    return {launch.RANKS_FOLDER: folder, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}


def wait_for(path, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def test_a_survivor_aborts_and_ends_once_its_launcher_notes_a_failed_peer(tmp_path):
    launch.write_atomically(tmp_path / f"{launch.PEER_FAILED}.0", "0")  # the first attempt's
    rank = multiprocessing.get_context("fork").Process(target=_survivor, args=(str(tmp_path),))
    rank.start()
    assert wait_for(tmp_path / "watching")
    rank.join(timeout=0.5)
    assert rank.is_alive() and not (tmp_path / "aborted").exists()
    launch.write_atomically(tmp_path / f"{launch.PEER_FAILED}.1", "0")  # this attempt's rank 0
    rank.join(timeout=120)
    assert rank.exitcode == 1 and (tmp_path / "aborted").exists()
    record = json.loads((tmp_path / "1.error.json").read_text())
    assert record["error"] == "a peer rank failed: communicators aborted"
    exit_ = launch.RankExit(rank=1, error=record["error"], time=record["time"])
    assert exit_.consequence  # the report names the rank that failed first, not this one


def _failing_rank(folder: str) -> None:
    (Path(folder) / "0.started.2").write_text("")  # a rank of the third attempt
    launch.write_atomically(Path(folder) / "0.pid", str(os.getpid()))  # as ranks write it
    os._exit(3)


def test_the_launcher_notes_a_failed_rank_for_its_peers(tmp_path):
    with launch.RankWatch(nproc=1) as watch:
        rank = multiprocessing.get_context("fork").Process(
            target=_failing_rank, args=(str(watch.folder),)
        )
        rank.start()
        assert wait_for(watch.folder / f"{launch.PEER_FAILED}.2")
        rank.join(timeout=60)
        assert [exit_.error.split(" (")[0] for exit_ in watch.failures()] == [
            "exited with status 3"
        ]
