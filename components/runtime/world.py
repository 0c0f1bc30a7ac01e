"""Joining the world as a rank: the process group of the launcher's environment (each attempt of a
restart its own store prefix), this rank's device and CPU threads, the GPUs visible without starting
CUDA, and, in a local launch, the end of this rank when its launcher says a peer failed.

Design notes: docs/design-notes.md
"""

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from components.processes import die_with_parent
from components.runtime.heartbeat import RANKS_FOLDER
from components.runtime.launch import PEER_FAILED, write_atomically

_PEER_WATCH_S = 0.05


def init_process_group(
    backend: str, timeout: timedelta, device_id: torch.device | None = None
) -> None:
    """Join the world described by the launcher's environment; every collective gives up after
    ``timeout`` instead of hanging forever when a peer has died or stopped. ``device_id``: this
    rank's GPU (set as the current device first), which binds NCCL's communicators to it. The
    process dies with its parent (the launcher, :func:`die_with_parent`)."""
    die_with_parent()
    store, rank, world_size = attempt_store(timeout)
    bound = {} if device_id is None else {"device_id": device_id}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound
    )


def attempt_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) of the launcher's environment (``env://``), the store seen through
    a prefix of its own per attempt. Torch elastic keeps one store for all attempts of a run and
    torch names the default group's keys (``default_pg/...``) and every other group (``0``, ``1``,
    ...) alike in each attempt, so without the prefix a restarted rank could read the address a
    dead rank of the previous attempt had posted there (gloo: ``connectFullMesh failed ...
    Connection refused``, or a connection to a stale port that hangs)."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return (
        dist.PrefixStore(f"shardtune/attempt_{attempt}/world_{world_size}/", store),
        rank,
        world_size,
    )


def cpu_threads_per_rank(setting: int | None, local_ranks: int) -> int:
    """Intra-op threads for each of ``local_ranks`` ranks on the CPU: ``setting``, else
    ``OMP_NUM_THREADS`` as the launch saw it, else the cores shared by the local ranks (more threads
    than cores only thrash)."""
    if setting is not None:
        return setting
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // local_ranks)


def join_world(
    device_type: str, timeout: timedelta, cpu_threads: int, seed: int, tf32: bool = True
) -> torch.device:
    """Join the process group of the launcher's environment and return this rank's device: the GPU
    named by ``LOCAL_RANK`` on CUDA (made current before the group exists; NCCL for its tensors,
    gloo for the default group's CPU ones; fp32 matmuls in TF32 unless ``tf32`` is False), else the
    CPU with ``cpu_threads`` intra-op threads. Seeds torch's RNG with ``seed``. Under torchrun the
    group may exist already (joined to wait for rank 0's plan)."""
    joined = dist.is_initialized()
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        if not joined:
            abort_when_a_peer_fails()  # first: a peer may fail while this rank waits to join
            init_process_group("cpu:gloo,cuda:nccl", timeout, device_id=device)
    else:
        if not joined:
            init_process_group("gloo", timeout)
        torch.set_num_threads(cpu_threads)
        device = torch.device("cpu")
    torch.manual_seed(seed)
    return device


def visible_gpus() -> int:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied), counted without starting
    CUDA, which would make every rank forked afterwards fail ("Cannot re-initialize CUDA in forked
    subprocess"): NVML counts them, as ``torch.cuda.device_count`` does before CUDA starts but
    without its fall-back to the CUDA runtime; where NVML cannot (MIG UUIDs), a child process
    counts. 0 without a CUDA build of torch or an NVIDIA driver."""
    if not torch.cuda._is_compiled():
        return 0
    if torch.cuda.is_initialized():  # too late to keep CUDA out: its own count is safe now
        return torch.cuda.device_count()
    if not _nvidia_driver_present():
        return 0
    count = torch.cuda._device_count_nvml()
    return count if count >= 0 else _gpus_counted_in_a_child()


def _nvidia_driver_present() -> bool:
    """Whether NVML's library (installed with the NVIDIA driver) loads."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _gpus_counted_in_a_child() -> int:
    """``torch.cuda.device_count()`` in a fresh interpreter: CUDA starts there, not here."""

    code = "import torch; print(torch.cuda.device_count())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def abort_when_a_peer_fails(abort: Callable[[], None] | None = None) -> threading.Thread | None:
    """In a local launcher's rank: watch for its note that a peer failed, then ``abort`` (default:
    every process group's communicators) and end this process. On NCCL a survivor blocks inside a
    CUDA wait where no signal handler runs (torch elastic SIGKILLs it 30 s later, its error
    unsaid); aborting makes that wait raise within a second. Gloo needs none: a lost peer's
    connection closes. Returns the watch thread, or None outside a local launch."""
    folder = os.environ.get(RANKS_FOLDER)
    if folder is None:
        return None
    abort = abort or dist.distributed_c10d._abort_process_group
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an earlier one's note is old
    note = Path(folder, f"{PEER_FAILED}.{attempt}")
    thread = threading.Thread(target=_watch_peers, args=(note, abort), name="peer-watch")
    thread.daemon = True
    thread.start()
    return thread


def _watch_peers(note: Path, abort: Callable[[], None]) -> None:
    folder = note.parent
    while not note.exists():
        time.sleep(_PEER_WATCH_S)
    rank = os.environ.get("RANK", "?")
    record = {"error": "a peer rank failed: communicators aborted", "time": time.time()}
    with contextlib.suppress(OSError):
        write_atomically(folder / f"{rank}.error.json", json.dumps(record | {"traceback": None}))
    with contextlib.suppress(Exception):  # whatever the abort raises, this rank ends
        abort()
    time.sleep(_ABORT_GRACE_S)  # the main thread's wait raises and the rank unwinds, or:
    os._exit(1)


_ABORT_GRACE_S = 5.0
