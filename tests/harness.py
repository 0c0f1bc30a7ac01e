"""Run a test's check on N gloo ranks, as real processes, cheaply and with a hard timeout.

A ``RankPool`` forks ``world_size`` workers from the pytest process (torch is already imported, so a
rank starts in milliseconds instead of the ~5 s a fresh interpreter needs), each joins one gloo
process group on a fresh port, and then runs check after check sent to it: one process group serves
every check of a test module. Measured here (2 cores, torch 2.13, gloo): a pool starts, process
group included, in 0.03 s for 2 ranks and 0.5 s for 4 (gloo's pairwise connections); a trivial check
then takes 2-8 ms. A fresh interpreter per rank would cost about 5 s each just to import torch and
transformers.

A check is a module-level function ``fn(rank, world_size, *args)`` (pickled by reference and found
in the forked copy of its module). ``run`` returns every rank's return value. If a rank raises, its
traceback becomes the pytest failure; if a rank does not answer within the timeout (a hang in a
collective), every rank is killed, the test fails, and the next ``run`` starts a fresh pool.
"""

import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from components.distributed.layout import Meshes, ParallelDims
from components.runtime.launch import free_port
from tests.stacks import python_stacks

# A collective waits at most this long in gloo, and a check at most DEFAULT_TIMEOUT_S in the parent.
COLLECTIVE_TIMEOUT_S = 30
DEFAULT_TIMEOUT_S = 60
# After one rank fails, its peers get this long to finish (they usually raise too) before all are
# killed.
FAILURE_GRACE_S = 3


def _worker(rank: int, world_size: int, port: int, conn: mp.connection.Connection) -> None:
    code = 0
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        torch.set_num_threads(1)  # several ranks share 2 cores
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        conn.send(("ready", None))
        while (message := conn.recv()) is not None:
            fn, args = message
            try:
                conn.send(("ok", fn(rank, world_size, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
        dist.destroy_process_group()
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        os._exit(code)  # never run the forked pytest's exit handlers


class RankPool:
    """``world_size`` forked gloo ranks that run checks on request (see the module docstring)."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._processes: list[mp.Process] = []
        self._conns: list[mp.connection.Connection] = []

    def _start(self) -> None:
        context = mp.get_context("fork")
        port = free_port()
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_worker, args=(rank, self.world_size, port, child_end), daemon=True
            )
            process.start()
            child_end.close()
            self._processes.append(process)
            self._conns.append(parent_end)
        self._gather("start", self.timeout_s)

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results in rank
        order."""
        if not self._processes:
            self._start()
        for conn in self._conns:
            conn.send((fn, args))
        return self._gather(getattr(fn, "__name__", str(fn)), timeout_s or self.timeout_s)

    def _gather(self, what: str, timeout_s: float) -> list:
        results: list = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in mp.connection.wait(list(pending.values()), timeout=remaining):
                rank = self._conns.index(conn)
                del pending[rank]
                try:
                    status, payload = conn.recv()
                except EOFError:
                    status, payload = (
                        "error",
                        f"rank {rank} exited with code {self._processes[rank].exitcode}",
                    )
                if status == "error":
                    errors[rank] = payload
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                else:
                    results[rank] = payload
        if not errors and not pending:
            return results
        hung = [self._processes[rank].pid for rank in sorted(pending)]
        stacks = python_stacks(hung) if hung else ""  # before the kill
        self.close(kill=True)
        report = [f"{what} failed on {self.world_size} ranks"]
        report += [f"--- rank {rank} raised:\n{tb}" for rank, tb in sorted(errors.items())]
        if pending:
            report.append(
                f"--- ranks {sorted(pending)} did not answer within {timeout_s:.0f} s and were "
                "killed; their stacks:"
            )
            report.append(stacks)
        pytest.fail("\n".join(report), pytrace=False)

    def close(self, kill: bool = False) -> None:
        for conn, process in zip(self._conns, self._processes, strict=True):
            if kill:
                process.kill()
            else:
                try:
                    conn.send(None)
                except OSError:
                    process.kill()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._conns = [], []


_MESHES: dict[tuple, DeviceMesh] = {}
_RUN_MESHES: dict[ParallelDims, Meshes] = {}


def tiny_model_folder(root: Path) -> Path:
    """``root/model``: a tiny Llama's weights, config and a trained tokenizer (model=pretrained)."""
    from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
    from components.models import build_causal_lm
    from recipes.tiny_models import tiny_config

    folder = root / "model"
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    build_causal_lm(tiny_config("llama", vocab_size=len(tokenizer)), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh over ranks 0..N-1 in row-major order, cached so a module's checks share its
    groups."""
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(
            "cpu",
            torch.arange(int(torch.tensor(shape).prod())).reshape(shape),
            mesh_dim_names=names,
        )
    return _MESHES[key]


def meshes(dims: ParallelDims) -> Meshes:
    """``dims.build_meshes("cpu")``, cached so a module's checks share their groups."""
    if dims not in _RUN_MESHES:
        _RUN_MESHES[dims] = dims.build_meshes("cpu")
    return _RUN_MESHES[dims]


def spec_for(
    config,
    sequence_parallel: bool = False,
    precision: str = "fp32",
    checkpointing: str = "none",
    weights=None,
):
    """A dense model's ``ModelSpec`` as the recipe makes it (seed 0, no experts, no compile)."""
    from components.models.parallelize import ModelSpec

    return ModelSpec(
        config=config,
        weights=weights,
        seed=0,
        sequence_parallel=sequence_parallel,
        experts=(),
        routers=(),
        precision=precision,
        activation_checkpointing=checkpointing,
        compile=False,
    )
