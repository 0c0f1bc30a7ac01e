"""Checkpoint saves and the training step: sync (``checkpoint.async=false``) against async
(``true``).

Why: every sync save blocks training for the whole write; an async save (DCP ``async_save`` through
:class:`components.checkpoint.writer.CheckpointWriter`) should block only for its copy to CPU
memory, and the steps while it is written should cost about a step without one (issue 24's goal: <=
1.15x).

On ``--ranks`` gloo ranks (``launch_local``), each holding a plain MLP of ``--mib`` MiB of fp32
weights (AdamW: the checkpoint is about 3x that per rank), each repetition runs, in a rotating
order:

- ``plain``: one step, no save;
- ``sync``: one step, then a blocking save (its time reported as ``blocks``);
- ``async``: one step, then the async save's start (``blocks``), then steps while it is written,
  timed one by one (``in flight``), until every rank has written it; then its publish (``publish``).

A time is the slowest rank's (barrier before each timed part); medians over repetitions. The load
average is printed at the start and the end: the machine is shared. Run: ``python
bench/checkpoint_async.py``.
"""

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter
from components.runtime.launch import launch_local


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _timed(action) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    return _slowest(time.perf_counter() - started)


def _rank(root: str, mib: int, reps: int, threads: int) -> dict[str, list[float]] | None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(256, width)

    def step() -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()

    writers = {
        kind: CheckpointWriter(
            Path(root) / kind, keep=1, run_id=kind, run_info=None, asynchronous=kind == "async"
        )
        for kind in ("sync", "async")
    }
    times: dict[str, list[float]] = {
        "plain": [],
        "sync blocks": [],
        "async blocks": [],
        "in flight": [],
    }
    times["publish"] = []
    step()
    number = 0
    for rep in range(reps):
        order = ["plain", "sync", "async"]
        order = order[rep % 3 :] + order[: rep % 3]
        for kind in order:
            times["plain"].append(_timed(step))
            if kind == "plain":
                continue
            number += 1
            writer = writers[kind]
            state = TrainState(model=model, optimizer=optimizer, schedule=None, step=number)
            save = functools.partial(writer.save, state)
            times[f"{kind} blocks"].append(_timed(save))
            while writer.in_flight:
                times["in flight"].append(_timed(step))
                started = time.perf_counter()
                writer.after_step(False)  # publishes once every rank has written it
                if not writer.in_flight:
                    times["publish"].append(_slowest(time.perf_counter() - started))
    dist.destroy_process_group()
    return times if int(os.environ["RANK"]) == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64, help="fp32 weights per rank, MiB")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    root = tempfile.mkdtemp(prefix="checkpoint-async-")
    try:
        results = launch_local(
            _rank, arguments.ranks, root, arguments.mib, arguments.reps, arguments.threads
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = results[0]
    plain = statistics.median(times["plain"])
    print(
        f"{arguments.ranks} ranks, {arguments.mib} MiB weights per rank, {arguments.reps} "
        "repetitions"
    )
    print("| measure | n | median ms | × plain step |")
    print("|---|---|---|---|")
    for name, values in times.items():
        if values:
            median = statistics.median(values)
            print(f"| {name} | {len(values)} | {median * 1e3:.1f} | {median / plain:.2f} |")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
