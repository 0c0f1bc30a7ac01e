"""Replica gradient sync: ``synchronize_tp_replica_gradients`` against its floor, AutoModel 0.7.0,
per-tensor.

Why: the parameters TP does not shard (norms, q/k norms, routers) need one gradient reduction per
optimizer step. The question is how close ours is to the best any compliant sync can do, and whether
it beats the module it reimplements (NeMo AutoModel 0.7.0's ``tp_replicas.py``).

Variants, run in one gloo process group per world size, alternated (the order rotates every
repetition):

- ``ours``: ``synchronize_tp_replica_gradients([model], mesh)`` called every repetition on the
  same model, as ``recipes/finetune_rank.py`` calls it once per step (its plan and buffers are
  kept with the model), gradients kept between calls (as with ``zero_grad(set_to_none=False)``):
  FP32 gradients are views of the persistent bucket, reduced in place.
- ``ours_fresh``: the same, but every call sees fresh gradient tensors made by hand (a caller
  that replaces ``.grad``): they are packed and re-bound to the bucket. The fresh tensors are made
  before the timed region.
- ``ours_step``: the recipe's step: ``zero_grad(set_to_none=True)``,
  ``zero_tp_replica_gradients`` (the buckets bound as the gradients), a backward (one multiply per
  parameter), the sync. Timed: the binding plus the sync; the backward apart, as
  ``ours_step:backward``.
- ``fresh_step``: the same step without the binding (the recipe before issue 49): the backward
  makes fresh gradients and the sync packs them. Timed: the sync; ``fresh_step:backward`` apart.
- ``check_floor_step``: the same step with ``check_floor`` in place of the sync: the floor right
  after a backward (whose cold caches and freed temporaries every step's sync meets), which the
  step variants are judged against.
- ``mean_floor_step``: ``check_floor_step`` and the mean's divide (one multiply over the buffer)
  that ``tp_replicas-notes.md`` requires after the SUM all-reduce: the floor of a sync that keeps
  the spec (reported, not judged).
- ``automodel``:
  ``nemo_automodel.components.distributed.tp_replicas.synchronize_tp_replica_gradients`` of
  nemo-automodel 0.7.0, the one file fetched from the package index at run time (``pip download
  --no-deps`` into ``~/.cache/shardtune/bench``, or ``$SHARDTUNE_CACHE/bench``; never committed) and
  imported alone.
- ``per_tensor``: one in-place all-reduce per gradient (bf16 upcast to FP32 and back), then divide
  (HF hooks).
- ``floor``: one all-reduce of a preallocated FP32 buffer of the bytes ``ours`` puts on the wire.
- ``check_floor``: the int32 [3, tensors] pre-check all-reduce, then the floor: what any sync that
  keeps the contract of ``tp_replicas-notes.md`` (one pre-check before data moves) must pay at
  least.

Time: every rank waits at a barrier, runs the variant and records its elapsed time; a repetition's
time is the slowest rank's; the median is reported. Extra memory: rank 0's peak resident set above
the resident set before a call (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), on a
fresh model per variant: the larger of the first call (which allocates any persistent buffer) and a
second call. RSS has page and allocator granularity: a goal line allows 1 MiB above 256 MiB for it.
"""

import importlib.util
import os
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.distributed.tp_replicas import (
    synchronize_tp_replica_gradients,
    zero_tp_replica_gradients,
)
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group

MIB = 1024 * 1024
WARMUP = 1
# per_tensor takes 0.1-6 s a call on the small sets (100-300x ours) and only has to show a >= 10x
# gap: it runs in the first PER_TENSOR_REPS repetitions, so the millisecond variants can afford more
# (a bimodal spread from gloo's thread wake-ups on 2 cores moves a median of 31 by up to 1.5x from
# run to run)
PER_TENSOR_REPS = 11
VARIANTS = (
    "ours",
    "ours_fresh",
    "ours_step",
    "fresh_step",
    "automodel",
    "per_tensor",
    "floor",
    "check_floor",
    "check_floor_step",
    "mean_floor_step",
)
# variants that time themselves (their backward apart)
STEPS = ("ours_step", "fresh_step", "check_floor_step", "mean_floor_step")
AUTOMODEL = "nemo-automodel==0.7.0"
AUTOMODEL_FILE = "nemo_automodel/components/distributed/tp_replicas.py"
# issue 49: ≤ 1.2× check+floor on the small sets, ≤ 1.1× on the large, ≤ 0.5× AutoModel (small)
SMALL_RATIO_GOAL, LARGE_RATIO_GOAL, SPEEDUP_GOAL, MEMORY_GOAL = 1.2, 1.1, 10.0, 256 * MIB
AUTOMODEL_GOAL = 2.0  # AutoModel ÷ ours on the small sets


class Holder(nn.Module):
    """A module that owns one replicated weight (a norm, a router)."""

    def __init__(self, numel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))


def _holders(count: int, numel: int, dtype: torch.dtype) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(Holder(numel, dtype) for _ in range(count))
    return model


# key: (description, builder, repetitions, large)
SETS: dict[str, tuple[str, Callable[[], nn.Module], int, bool]] = {
    "norms": (
        "65 × 4096 fp32 (an 8B model's norms)",
        lambda: _holders(65, 4096, torch.float32),
        61,
        False,
    ),
    "many": ("1,000 × 1,024 fp32", lambda: _holders(1000, 1024, torch.float32), 61, False),
    "mid": ("16 × 1M fp32 (64 MiB)", lambda: _holders(16, 1 << 20, torch.float32), 21, True),
    "big": ("64 × 1M fp32 (256 MiB)", lambda: _holders(64, 1 << 20, torch.float32), 7, True),
    "big_bf16": (
        "64 × 1M bf16 (256 MiB on the wire)",
        lambda: _holders(64, 1 << 20, torch.bfloat16),
        7,
        True,
    ),
}


def fetch_automodel() -> Path:
    """The path of AutoModel 0.7.0's ``tp_replicas.py``, downloaded once from the package index into
    a cache."""
    cache = Path(os.environ.get("SHARDTUNE_CACHE", Path.home() / ".cache" / "shardtune")) / "bench"
    target = cache / "automodel_0_7_0_tp_replicas.py"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            AUTOMODEL,
            "-d",
            str(cache),
            "-q",
        ]
        subprocess.run(command, check=True)
        wheel = next(cache.glob("nemo_automodel-0.7.0-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            target.write_bytes(archive.read(AUTOMODEL_FILE))
    return target


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location("automodel_tp_replicas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wire_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # every gradient travels as FP32 (or wider)


@torch.no_grad()
def per_tensor(model: nn.Module, world: int) -> None:
    for parameter in model.parameters():
        grad = parameter.grad
        wire = grad if grad.dtype == torch.float32 else grad.float()
        dist.all_reduce(wire)
        wire.div_(world)
        if wire is not grad:
            grad.copy_(wire)


def _fresh_grads(model: nn.Module) -> None:
    for parameter in model.parameters():
        parameter.grad = parameter.grad.clone()


def _step(
    model: nn.Module,
    bind: Callable[[], object] | None,
    sync: Callable[[], object],
    ours: Callable[[], object],
    backward_s: list[float],
) -> float:
    """One recipe step on ``model``: zero_grad(set_to_none=True), ``bind`` (if any), a backward,
    ``sync``; returns this rank's seconds of ``bind`` and ``sync`` (the backward's go to
    ``backward_s``). A ``sync`` other than ``ours`` is followed by ``ours``, untimed, so the next
    variant finds the gradients where a sync leaves them."""
    scale = float(dist.get_rank() + 1)
    model.zero_grad(set_to_none=True)
    dist.barrier()
    started = time.perf_counter()
    if bind is not None:
        bind()
    timed = time.perf_counter() - started
    loss = sum(parameter.mul(scale).sum() for parameter in model.parameters())
    started = time.perf_counter()
    loss.backward()
    backward_s.append(time.perf_counter() - started)
    dist.barrier()
    started = time.perf_counter()
    sync()
    timed += time.perf_counter() - started
    if sync is not ours:  # untimed: leave the gradients in the buckets, as every other step does
        ours()
    return timed


def _variants(
    model: nn.Module, mesh: DeviceMesh, automodel, world: int, backward: dict | None = None
) -> dict[str, Callable[[], float | None]]:
    floor = torch.ones(_wire_numel(model), dtype=torch.float32)
    flags = torch.ones(3, sum(1 for _ in model.parameters()), dtype=torch.int32)

    def check_floor() -> None:
        dist.all_reduce(flags)
        dist.all_reduce(floor)

    def mean_floor() -> None:  # the floor and the mean's divide the spec requires after the SUM
        check_floor()
        floor.mul_(1.0 / world)

    def ours() -> None:  # the spec's free function, once per step on the same model
        synchronize_tp_replica_gradients([model], mesh)

    def bind() -> None:
        zero_tp_replica_gradients([model], mesh)

    return {
        "ours": ours,
        "ours_fresh": ours,
        "ours_step": lambda: _step(model, bind, ours, ours, backward["ours_step"]),
        "fresh_step": lambda: _step(model, None, ours, ours, backward["fresh_step"]),
        "check_floor_step": lambda: _step(
            model, None, check_floor, ours, backward["check_floor_step"]
        ),
        "mean_floor_step": lambda: _step(
            model, None, mean_floor, ours, backward["mean_floor_step"]
        ),
        "automodel": lambda: automodel.synchronize_tp_replica_gradients([model], mesh),
        "per_tensor": lambda: per_tensor(model, world),
        "floor": lambda: dist.all_reduce(floor),
        "check_floor": check_floor,
    }


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _peak_above_rss(run: Callable[[], None]) -> int | None:
    """Bytes of rank 0's peak resident set during ``run`` above its resident set before (every rank
    runs it)."""
    dist.barrier()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    before = _rss_kib("VmRSS:")
    run()
    return max(0, _rss_kib("VmHWM:") - before) * 1024


def _extra_memory(
    build: Callable[[], nn.Module], mesh: DeviceMesh, automodel, world: int
) -> dict[str, int | None]:
    """Per variant on a fresh model: the larger of the first call's peak RSS above the RSS before it
    (persistent buffers are allocated then) and a second call's (its transients on top of them)."""
    out: dict[str, int | None] = {}
    for name in VARIANTS:
        model = build()
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        run = _variants(model, mesh, automodel, world, {step: [] for step in STEPS})[name]
        if name in ("floor", "check_floor", "check_floor_step"):
            out[name] = 0  # preallocated: the floor's buffer stands for the gradients themselves
            continue
        if name in STEPS:
            out[name] = None  # its peak would be the backward's, not the sync's
            continue
        first = _peak_above_rss(run)  # persistent buffers are allocated here
        if first is None:
            out[name] = None
            continue
        if name == "ours_fresh":
            _fresh_grads(
                model
            )  # outside the measured window: the fresh gradients are not the sync's
        second = _peak_above_rss(run)
        out[name] = max(first, second or 0)
        del model, run
    return out


def _time_set(
    build: Callable[[], nn.Module], reps: int, mesh: DeviceMesh, automodel, world: int
) -> dict:
    torch.manual_seed(dist.get_rank())
    model = build()
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    backward: dict[str, list[float]] = {name: [] for name in STEPS}
    runs = _variants(model, mesh, automodel, world, backward)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rep in range(WARMUP + reps):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for name in order:
            if name == "per_tensor" and rep >= WARMUP + PER_TENSOR_REPS:
                continue
            if name == "ours_fresh":
                _fresh_grads(model)
            dist.barrier()
            started = time.perf_counter()
            timed = runs[name]()
            elapsed = timed if name in STEPS else time.perf_counter() - started  # steps: their own
            if rep >= WARMUP:
                times[name].append(elapsed)
    for name in STEPS:
        times[f"{name}:backward"] = backward[name][WARMUP:]
    slowest = {}
    for name in times:
        samples = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(samples, op=dist.ReduceOp.MAX)
        slowest[name] = samples.tolist()
    return {
        "tensors": sum(1 for _ in model.parameters()),
        "wire_bytes": _wire_numel(model) * 4,
        "median_s": {name: statistics.median(samples) for name, samples in slowest.items()},
        "reps": {name: len(samples) for name, samples in slowest.items()},
    }


def _rank(sets: list[str], automodel_path: str, threads: int) -> dict:
    init_process_group("gloo", timedelta(minutes=5))
    torch.set_num_threads(threads)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    automodel = _load_module(Path(automodel_path))
    results = {}
    for key in sets:
        _, build, reps, _ = SETS[key]
        results[key] = _time_set(build, reps, mesh, automodel, world)
        results[key]["extra_bytes"] = _extra_memory(build, mesh, automodel, world)
    dist.destroy_process_group()
    return results


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _floor_of(name: str) -> str:
    """What a variant is judged against: the floor right after a backward for the steps."""
    return "check_floor_step" if name in STEPS else "check_floor"


def _goal_lines(key: str, world: int, r: dict) -> list[str]:
    t = r["median_s"]
    tag = f"({key}, {world} ranks)"
    large = SETS[key][3]
    goal, faster_goal = (LARGE_RATIO_GOAL, 1.0) if large else (SMALL_RATIO_GOAL, AUTOMODEL_GOAL)
    lines = []
    for name in ("ours", "ours_step", "ours_fresh", "fresh_step"):
        ratio, faster = t[name] / t[_floor_of(name)], t["automodel"] / t[name]
        judged = name in ("ours", "ours_step")  # the others: a replaced gradient, the old step
        verdict = (lambda ok: "PASS" if ok else "MISS") if judged else (lambda ok: "INFO")
        lines.append(
            f"{verdict(ratio <= goal)} replica_sync {tag}: {name} {ratio:.2f}× {_floor_of(name)}"
            + (f" (goal ≤ {goal}×)" if judged else "")
        )
        lines.append(
            f"{verdict(faster >= faster_goal)} replica_sync {tag}: {name} {faster:.2f}× faster "
            "than AutoModel 0.7.0" + (f" (goal ≥ {faster_goal}×)" if judged else "")
        )
    spec_floor = t["mean_floor_step"] / t["check_floor_step"]
    lines.append(
        f"INFO replica_sync {tag}: the spec's divide after the SUM alone makes the floor "
        f"{spec_floor:.2f}×; ours_step {t['ours_step'] / t['mean_floor_step']:.2f}× that"
    )
    backward = t["ours_step:backward"] / t["fresh_step:backward"]
    lines.append(
        f"INFO replica_sync {tag}: the backward into bound buckets takes {backward:.2f}× the "
        "backward into fresh gradients"
    )
    if key == "many":
        speedup = t["per_tensor"] / t["ours_fresh"]
        lines.append(
            f"{'PASS' if speedup >= SPEEDUP_GOAL else 'MISS'} replica_sync {tag}: per-tensor "
            f"{speedup:.1f}× "
            f"slower than ours_fresh (goal ≥ {SPEEDUP_GOAL:.0f}×)"
        )
    extra = max(v or 0 for k, v in r["extra_bytes"].items() if k.startswith("ours"))
    lines.append(
        f"{'PASS' if extra <= MEMORY_GOAL + MIB else 'MISS'} replica_sync {tag}: extra memory "
        f"{extra / MIB:.1f} MiB "
        f"(goal ≤ {MEMORY_GOAL // MIB} MiB)"
    )
    return lines


def _rows(key: str, world: int, r: dict) -> list[str]:
    """The table's rows of one set: every variant, then the step variants' backward (no ratio)."""
    t, rows = r["median_s"], []
    for name, median in t.items():
        ratios = (
            "– | –"
            if name.endswith(":backward")
            else (f"{median / t[_floor_of(name)]:.2f} | {median / t['floor']:.2f}")
        )
        rows.append(
            f"| {SETS[key][0]} | {world} | {r['reps'][name]} | {name} | {median * 1e3:.2f} "
            f"| {ratios} | {_mib(r['extra_bytes'].get(name))} |"
        )
    return rows


def run(
    world_sizes: tuple[int, ...] = (2, 4), sets: tuple[str, ...] = tuple(SETS), threads: int = 1
) -> list[str]:
    """Measure every set at every world size; print the table and the goal lines; return the goal
    lines."""
    automodel = str(fetch_automodel())
    load = [os.getloadavg()[0]]
    lines = [
        "### Replica gradient sync (gloo, CPU)",
        "",
        f"{threads} thread(s) per rank; median of the slowest rank over the repetitions after "
        f"{WARMUP} warm-up.",
        "",
        "| set | ranks | reps | variant | median ms | × check+floor (steps: its step's) | × floor "
        "| extra memory MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    goals = []
    for world in world_sizes:
        result = launch_local(_rank, world, list(sets), automodel, threads)[0]
        start = len(lines)
        for key in sets:
            lines += _rows(key, world, result[key])
            goals += _goal_lines(key, world, result[key])
        print("\n".join(lines[start:]), flush=True)  # progress: this world size's rows
    load.append(os.getloadavg()[0])
    lines += ["", f"Load average (1 min) at start {load[0]:.2f}, at end {load[1]:.2f}."]
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


# --- overlap: how much of the sync ReplicaSyncOverlap hides behind the last backward
# ----------------


def _overlap_rank(threads: int, reps: int) -> dict[str, float]:
    from components.distributed.replica_sync_overlap import ReplicaSyncOverlap

    init_process_group("gloo", timedelta(minutes=5))
    torch.set_num_threads(threads)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Linear(1024, 1024) for _ in range(12)]
    )  # 48 MiB of replicated gradients
    inputs = torch.randn(2, 64, 1024, generator=torch.Generator().manual_seed(dist.get_rank()))
    overlap = ReplicaSyncOverlap([model], mesh)
    overlap.remove()

    def step(mode: str) -> None:
        model.zero_grad(set_to_none=False)
        for micro in range(2):
            if mode == "overlap" and micro == 1:
                overlap.last_micro_batch()
            model(inputs[micro]).square().mean().backward()
        if mode == "boundary":
            synchronize_tp_replica_gradients([model], mesh)
        elif mode == "overlap":
            overlap.finish()

    modes = ("no_sync", "boundary", "overlap")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(WARMUP + reps):
        for mode in modes[rep % 3 :] + modes[: rep % 3]:
            if mode == "overlap":
                overlap = ReplicaSyncOverlap([model], mesh)
            dist.barrier()
            started = time.perf_counter()
            step(mode)
            elapsed = time.perf_counter() - started
            if mode == "overlap":
                overlap.remove()
            if rep >= WARMUP:
                times[mode].append(elapsed)
    slowest = torch.tensor([times[m] for m in modes], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {m: statistics.median(slowest[i].tolist()) for i, m in enumerate(modes)}


def run_overlap(world: int = 2, threads: int = 1, reps: int = 15) -> list[str]:
    """One step (2 micro-batches, 12 × Linear(1024, 1024) replicated) without sync, with the
    boundary sync and with ReplicaSyncOverlap; print the table and the share of the sync the overlap
    hides."""
    load = os.getloadavg()[0]
    t = launch_local(_overlap_rank, world, threads, reps)[0]
    sync = t["boundary"] - t["no_sync"]
    hidden = (t["boundary"] - t["overlap"]) / sync if sync > 0 else 0.0
    lines = [
        f"### Overlap ({world} ranks, {threads} thread(s) per rank, median of {reps}; load "
        f"{load:.2f} -> "
        f"{os.getloadavg()[0]:.2f})",
        "",
        "| step | median ms |",
        "|---|---|",
        *(f"| {mode} | {value * 1e3:.1f} |" for mode, value in t.items()),
        "",
        f"The boundary sync costs {sync * 1e3:.1f} ms per step; the overlap hides {hidden:.0%} of "
        "it.",
    ]
    print("\n".join(lines), flush=True)
    return [
        f"INFO replica_sync overlap ({world} ranks, {threads} thread(s)): hides {hidden:.0%} of "
        "the sync"
    ]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["overlap"]:
        for threads in (1, 2):
            run_overlap(2, threads)
    else:
        worlds = tuple(int(a) for a in arguments if a.isdigit()) or (2, 4)
        run(worlds, tuple(a for a in arguments if not a.isdigit()) or tuple(SETS))
