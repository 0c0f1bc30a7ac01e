"""``dry_run=true``: the checked run plan, built for its layout on fake ranks, priced, and not run.

Every check of the recipe has run (``recipes/checks.py``); then this process joins torch's fake
process group (``torch.testing._internal.distributed.fake_pg``: every collective returns at once
and moves nothing) as rank 0 of the requested world, and builds the model exactly as a rank would
(``build_parallel_model``: TP plan, expert parallelism, activation checkpointing, FSDP over dp) on
the meta device, so a plan, placement or shape error a launch would hit is raised here, for any
world size, and nothing is allocated at full size. The local shards price the state; the batch
geometry prices the rest (``components.planning.memory_model``). It prints a table and writes
``${output_dir}/plan.json``; with ``device_memory_gib`` (or the visible GPU's memory) it says
whether the layout fits, and if not the smallest change that does: activation checkpointing, a
smaller micro-batch, a larger tp, a larger cp (each on the same world: fewer dp ranks), then pairs
of them; each candidate is planned again the same way and reported only when that plan fits.
"""

import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from components.distributed.mesh import ParallelDims, build_device_mesh
from components.models.conversion import convert_model
from components.models.parallelize import build_parallel_model
from components.planning.flops import known_flops_per_token
from components.planning.memory import current_memory_gib
from components.planning.memory_model import GIB, Layout, MemoryEstimate, Step, estimate_memory
from components.planning.memory_model import optimizer_moments as moments_of

ROWS = ("params", "grads", "optimizer", "activations", "buffers", "runtime", "total")


def plan_layout(plan, step: Step, layout: Layout) -> MemoryEstimate:
    """Build ``plan``'s model for ``layout`` on the meta device over the fake world; price it."""
    world = plan.dims.world_size
    sizes = dict(dp=layout.dp, tp=layout.tp, ep=layout.ep, cp=layout.cp)
    dims = ParallelDims(world_size=world, dp_replicate=layout.dp_replicate, **sizes)
    mesh = build_device_mesh(dims, "cpu")
    spec = replace(plan.model, activation_checkpointing=layout.activation_checkpointing)
    model, _ = build_parallel_model(
        spec, dims, mesh, torch.device("meta"), convert=_converter(plan, dims)
    )
    return estimate_memory(model, plan.model.config, layout, step)


def _converter(plan, dims: ParallelDims) -> Callable[[torch.nn.Module], torch.nn.Module] | None:
    """The recipe's conversion of the built model (``convert_model``), fp8's linears all-gathered
    in fp8 when ``dims`` shard over dp; None when nothing converts."""
    lora, fp8 = plan.lora, plan.fp8
    if lora is None and fp8 is None:
        return None
    fp8 = fp8 and replace(fp8, data_parallel=dims.data_parallel > 1)
    return functools.partial(convert_model, lora=lora, fp8=fp8, seed=plan.seed)


def _cp_sizes(plan, layout: Layout) -> list[int]:
    """The cp sizes above ``layout.cp`` that divide the world; none for an MoE model or under
    ``train.compile`` (both refused with cp > 1)."""
    world = plan.dims.world_size
    if plan.model.experts or plan.model.compile:
        return []
    return [c for c in range(layout.cp + 1, world + 1) if world % c == 0]


def _fits_the_world(plan, layout: Layout) -> bool:
    """dp × cp × tp is the world, the global batch splits over dp, and a row into 2·cp chunks
    (with sp, a rank's share into tp slices too), as ``recipes/checks.py`` requires."""
    world, train = plan.dims.world_size, plan.train
    sp = plan.model.sequence_parallel
    sequence = math.lcm(2 * layout.cp, layout.cp * layout.tp if sp else 1)
    return (
        layout.dp * layout.cp * layout.tp == world
        and train.global_batch_size % (layout.micro_batch_size * layout.dp) == 0
        and (layout.cp == 1 or train.seq_len % sequence == 0)
        and layout.dp % layout.dp_replicate == 0  # HSDP: dp_replicate groups of dp_shard
        and (layout.dp_replicate == 1 or layout.cp == 1)
    )


def _candidates(plan, layout: Layout) -> list[tuple[str, Layout]]:
    """Changes that lower the memory: single ones first (cheapest first), then pairs, then all. A
    larger tp or cp keeps the world: dp shrinks (its new size is named with the change)."""
    world = plan.dims.world_size
    changes = []
    if layout.activation_checkpointing != "full":
        full = {"activation_checkpointing": "full"}
        changes.append([("train.activation_checkpointing=full", full)])
    micro = layout.micro_batch_size
    batches = [m for m in range(micro - 1, 0, -1) if micro % m == 0]
    changes.append([(f"train.micro_batch_size={m}", {"micro_batch_size": m}) for m in batches])
    tps = [t for t in range(layout.tp + 1, world + 1) if world % t == 0]
    changes.append([(f"tp={t}", {"tp": t}) for t in tps])
    changes.append([(f"cp={c}", {"cp": c}) for c in _cp_sizes(plan, layout)])
    found = []
    for count in range(1, len(changes) + 1):
        for group in itertools.combinations(changes, count):
            for picks in itertools.product(*group):
                words = " ".join(word for word, _ in picks)
                fields = {key: value for _, change in picks for key, value in change.items()}
                candidate = replace(layout, **fields)
                if "tp" in fields or "cp" in fields:
                    dp = world // (candidate.tp * candidate.cp)
                    candidate, words = replace(candidate, dp=dp), f"{words} dp={dp}"
                    if layout.dp_replicate > 1:
                        words += f" dp_shard={dp // layout.dp_replicate}"
                if _fits_the_world(plan, candidate):
                    found.append((words, candidate))
    return found


def _suggest(plan, step: Step, layout: Layout, memory_gib: float) -> tuple[dict | None, list]:
    """The first candidate whose plan fits in ``memory_gib``; every candidate planned on the way."""
    tried = []
    for words, candidate in _candidates(plan, layout):
        try:
            total = plan_layout(plan, step, candidate).total
        except ValueError as error:  # e.g. a tp the heads do not divide: not a layout at all
            tried.append({"change": words, "error": str(error).split(";")[0]})
            continue
        tried.append({"change": words, "total_gib": round(total, 3), "fits": total <= memory_gib})
        if total <= memory_gib:
            return {"change": words, "total_gib": total}, tried
    return None, tried


def _step(plan) -> Step:
    train = plan.train
    runtime = current_memory_gib("cpu") if plan.device_type == "cpu" else 0.0
    moments = moments_of(plan.optim.target, plan.optim.options())
    return Step(
        seq_len=train.seq_len,
        global_batch_size=train.global_batch_size,
        precision=train.precision,
        sequence_parallel=plan.model.sequence_parallel,
        optimizer_moments=moments,
        device_type=plan.device_type,
        runtime_gib=runtime,
        loss_chunk_tokens=train.loss_chunk_tokens,
        packing=train.packing,
        fp8_recipe=train.fp8_recipe,
    )


def _device_memory_gib(asked: float | None) -> float | None:
    if asked is None and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return asked


def dry_run(plan, fail: Callable[[str], NoReturn]) -> dict:
    """Plan ``plan`` (a checked ``recipes.plan.RunPlan``) on fake ranks; print it, write plan.json.
    A layout that cannot be built (the error a launch would hit) goes to ``fail`` as one line."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims, train = plan.dims, plan.train
    checkpointing = train.activation_checkpointing
    layout = Layout(
        tp=dims.tp,
        dp=dims.dp,
        ep=dims.ep,
        micro_batch_size=train.micro_batch_size,
        cp=dims.cp,
        dp_replicate=dims.dp_replicate,
        activation_checkpointing=checkpointing,
    )
    step = _step(plan)
    memory = _device_memory_gib(plan.device_memory_gib)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        try:
            estimate = plan_layout(plan, step, layout)
        except (ValueError, RuntimeError) as error:
            fail(f"dry run: the model cannot be built for this layout: {error}")
        fits = None if memory is None else estimate.total <= memory
        suggestion, tried = _suggest(plan, step, layout, memory) if fits is False else (None, [])
    finally:
        dist.destroy_process_group()
    result = {
        "world_size": dims.world_size,
        "layout": {**asdict(layout), "sp": plan.model.sequence_parallel},
        "seq_len": train.seq_len,
        "precision": train.precision,
        "per_rank_gib": {row: getattr(estimate, row) for row in ROWS},
        "detail_gib": estimate.detail,
        "phases_gib": estimate.phases,
        "flops_per_token": known_flops_per_token(plan.model.config, train.seq_len),
        "device_memory_gib": memory,
        "fits": fits,
        "suggestion": suggestion,
        "tried": tried,
    }
    _write(plan.output_dir, result)
    return result


def _write(output_dir: Path, result: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
    print(format_plan(result))
    print(f"wrote {output_dir / 'plan.json'} (dry run: nothing trained)")


def format_plan(result: dict) -> str:
    """The printed table of a plan."""
    layout = result["layout"]
    dp, replicas = layout["dp"], layout.get("dp_replicate", 1)
    hsdp = f" (dp_replicate {replicas} × dp_shard {dp // replicas})" if replicas > 1 else ""
    lines = [
        f"dry run: world {result['world_size']} = dp {dp}{hsdp} × cp {layout['cp']} "
        f"× tp {layout['tp']} "
        f"(ep {layout['ep']}, sp {str(layout['sp']).lower()}), "
        f"micro-batch {layout['micro_batch_size']} "
        f"× seq {result['seq_len']}, {result['precision']}, activation checkpointing "
        f"{layout['activation_checkpointing']}",
        "per rank (GiB, the busiest rank):",
    ]
    lines += [f"  {row:<12}{result['per_rank_gib'][row]:>10.3f}" for row in ROWS]
    detail = result["detail_gib"].items()
    lines += [f"    {name:<34}{value:>8.3f}" for name, value in detail if value]
    flops = result["flops_per_token"]
    known = f"{flops:.4g} (forward + backward, no recompute)" if flops else "unknown: no sizes"
    lines.append(f"flops_per_token {known}")
    memory, fits = result["device_memory_gib"], result["fits"]
    if fits is None:
        lines.append("fits: unknown (set device_memory_gib=GIB to check a device's memory)")
    elif fits:
        lines.append(f"fits in {memory:g} GiB per device")
    elif result["suggestion"]:
        change = result["suggestion"]
        lines.append(
            f"does not fit in {memory:g} GiB per device; the smallest change that fits: "
            f"{change['change']} "
            f"(planned again: {change['total_gib']:.2f} GiB)"
        )
    else:
        lines.append(f"does not fit in {memory:g} GiB per device, and no change tried fits")
    return "\n".join(lines)
