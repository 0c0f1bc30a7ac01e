"""Replica gradient sync, old against new: the module-level caches of commit 32ac2ad
(``synchronize_tp_replica_gradients``) against today's ``ReplicaSync([model], mesh).synchronize()``.

Why: issue 22 asks that the ``ReplicaSync`` refactor keep issue 16's sync within 5% of the old
code on the same sets (those of ``bench/replica_sync.py``), in one alternating run of both.

How: the old files are read with ``git show 32ac2ad:<path>`` into a temporary package (their
``components.`` imports renamed), imported beside today's code and removed after the run. Each
variant (``old``, ``new`` and a twin of each, whose spread is the noise floor) syncs its own model,
all holding the same gradients; old and new must reduce them to the same bits. The order is
shuffled per repetition (seeded, the same on every rank); every rank waits at a barrier and runs
the variant; a repetition's time is the slowest rank's; the median is reported. 1 thread per rank.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/replica_sync_old_new.py`` on a quiet machine
(``--reps-small N --reps-big M`` to set repetitions, ``--quick`` for a smoke run).
"""

import argparse
import importlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from replica_sync import SETS
from torch.distributed.device_mesh import init_device_mesh

from components.distributed.replicas import ReplicaSync
from components.runtime.launch import init_process_group, launch_local

OLD_COMMIT = "32ac2ad"
OLD_FILES = (
    "components/distributed/tp_replicas.py",
    "components/distributed/replicas/plan.py",
    "components/distributed/replicas/flat_buffers.py",
)
PACKAGE = "shardtune_old_32ac2ad"
VARIANTS = ("old", "new", "old_twin", "new_twin")
WARMUP, SEED, GOAL = 1, 22, 1.05
ROOT = Path(__file__).resolve().parents[1]


def extract_old(folder: Path) -> None:
    """Write the old files under ``folder/PACKAGE`` with their imports renamed to it."""
    for path in OLD_FILES:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        target = folder / PACKAGE / Path(path).relative_to("components")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text.replace("components.", f"{PACKAGE}."))
    for package in (folder / PACKAGE).rglob("*"):
        if package.is_dir():
            (package / "__init__.py").touch()
    (folder / PACKAGE / "__init__.py").touch()


def _time_set(key: str, reps: int, mesh, old) -> dict:
    build, wall = SETS[key][1], time.monotonic()  # wall: build and timing, in seconds
    models = {name: build() for name in VARIANTS}
    torch.manual_seed(dist.get_rank())
    for parameters in zip(*(m.parameters() for m in models.values()), strict=True):
        grad = torch.randn_like(parameters[0])
        for parameter in parameters:
            parameter.grad = grad.clone()
    runs = {}
    for name, model in models.items():
        if name.startswith("old"):
            runs[name] = lambda model=model: old.synchronize_tp_replica_gradients([model], mesh)
        else:
            runs[name] = ReplicaSync([model], mesh).synchronize  # built once, as the recipe does

    def same_bits() -> bool:
        pairs = zip(models["old"].parameters(), models["new"].parameters(), strict=True)
        return all(torch.equal(a.grad, b.grad) for a, b in pairs)

    load, equal = [os.getloadavg()[0]], True
    order, times = random.Random(f"{SEED}/{key}/{mesh.size()}"), {n: [] for n in VARIANTS}
    for rep in range(WARMUP + reps):
        for name in order.sample(VARIANTS, len(VARIANTS)):
            dist.barrier()
            started = time.perf_counter()
            runs[name]()
            if rep >= WARMUP:
                times[name].append(time.perf_counter() - started)
        equal = equal and (rep > 0 or same_bits())  # the first call, on the same gradients
    flags = torch.tensor([equal and same_bits()], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    slowest = torch.tensor([times[n] for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    median = {n: statistics.median(slowest[i].tolist()) for i, n in enumerate(VARIANTS)}
    load.append(os.getloadavg()[0])
    wall = time.monotonic() - wall
    return {"median_s": median, "equal": bool(flags.item()), "load": load, "wall_s": wall}


def _rank(plan: list[tuple[str, int]], folder: str) -> dict:
    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(1)
    sys.path.insert(0, folder)
    old = importlib.import_module(f"{PACKAGE}.distributed.tp_replicas")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {key: _time_set(key, reps, mesh, old) for key, reps in plan}
    dist.destroy_process_group()
    return results


def run(reps_small: int, reps_big: int) -> list[str]:
    """Every set at 2 ranks, the small sets at 4 too; print the table; return the goal lines."""
    print(
        "| set | ranks | reps | old ms | new ms | new / old | twins: new / new, old / old "
        "| bits equal | load start, end | s |\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    goals = []
    with tempfile.TemporaryDirectory(prefix="replica_sync_old_") as folder:
        extract_old(Path(folder))
        for world in (2, 4):
            plan = [
                (key, reps_big if large else reps_small)
                for key, (_, _, _, large) in SETS.items()
                if world == 2 or not large
            ]
            results = launch_local(_rank, world, plan, folder)[0]
            for key, reps in plan:
                r = results[key]
                t, load = r["median_s"], r["load"]
                ratio = t["new"] / t["old"]
                print(
                    f"| {SETS[key][0]} | {world} | {reps} | {t['old'] * 1e3:.2f} "
                    f"| {t['new'] * 1e3:.2f} | {ratio:.2f} | {t['new_twin'] / t['new']:.2f}, "
                    f"{t['old_twin'] / t['old']:.2f} | {'yes' if r['equal'] else 'NO'} "
                    f"| {load[0]:.2f}, {load[1]:.2f} | {r['wall_s']:.0f} |",
                    flush=True,
                )
                verdict = "PASS" if ratio <= GOAL and r["equal"] else "MISS"
                goals.append(
                    f"{verdict} replica_sync_old_new ({key}, {world} ranks): new {ratio:.2f}× "
                    f"old (goal ≤ {GOAL}×), bits {'equal' if r['equal'] else 'DIFFER'}"
                )
    print("\n" + "\n".join(goals), flush=True)
    return goals


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps-small", type=int, default=401, help="65×4096 and 1,000×1,024")
    parser.add_argument("--reps-big", type=int, default=11, help="the 256 MiB sets (2 ranks)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 and 1 repetitions")
    arguments = parser.parse_args()
    quick = arguments.quick
    run(5 if quick else arguments.reps_small, 1 if quick else arguments.reps_big)
