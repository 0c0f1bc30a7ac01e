"""``dry_run=true``: the checked run plan, built for its layout on fake ranks, priced, and not run.

After every check of the recipe, this process joins torch's fake process group (collectives return
at once, move nothing) as a rank of the requested world and builds the model as that rank would
(``build_parallel_model``) on the meta device: a plan, placement or shape error a launch would hit
is raised here, for any world size, and nothing is allocated. The local shards and the batch
geometry price it (``components.planning.memory_model``). With pp > 1 each pipeline rank is
planned: the recipe's own cut (``pipeline.rank_share``) built on the fake rank at that pp coordinate
(the others 0: FSDP's busiest), once per distinct share, priced with the micro-batches its schedule
holds (``components.planning.pipeline_schedule``). It prints a table, writes plan.json; with
``device_memory_gib`` it says whether the layout fits, and if not the smallest change that does
(activation checkpointing, a smaller micro-batch, a larger tp, cp or pp on the same world, fewer
HSDP replicas, then pairs), each candidate planned again (at most ``MAX_PLANNED``), and the levers'
memory per rank (optimizer states in fewer bits, cpu offload where it fits, ``peft=qlora``).
"""

import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from components.data.loader import widest_batch
from components.distributed.layout import LayoutError, ParallelDims
from components.distributed.pipeline import rank_share, rank_stages
from components.models.conversion import convert_model
from components.models.frozen import build_frozen_model
from components.models.lora import LoraOptions
from components.models.options import OFFLOAD_ON_THE_CPU, PACKED_NATIVE
from components.models.parallelize import build_parallel_model
from components.planning.flops import known_flops_per_token
from components.planning.memory import current_memory_gib
from components.planning.memory_model import (
    GIB,
    Frozen,
    Layout,
    MemoryEstimate,
    Stage,
    Step,
    estimate_memory,
    optimizer_state_bits,
)
from components.planning.memory_model import optimizer_moments as moments_of
from components.planning.offload import host_row, host_words
from components.planning.pipeline_schedule import bubble, grads_held, in_flight

ROWS = ("params", "grads", "optimizer", "frozen", "activations", "buffers", "runtime", "total")
STAGE_ROWS = tuple(row for row in ROWS if row != "frozen")  # pp: no recipe with a frozen model
_STEP_FIELDS = ("micro_batch_size", "activation_checkpointing")  # a candidate's besides degrees
MAX_PLANNED = 24  # candidates planned again at most: each builds the model (pp: a few of them)


def _on_fake_rank(world: int, rank: int) -> None:
    """This process as ``rank`` of torch's fake process group of ``world`` ranks."""
    if dist.is_initialized():
        if dist.get_rank() == rank:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@dataclass(frozen=True, kw_only=True)
class Lever:
    """A change of the trained model a plan prices beside the run's own: LoRA adapters on its
    frozen base, in ``precision`` (and with ``nf4_base``, that base in NF4)."""

    lora: LoraOptions
    precision: str
    nf4_base: bool = False  # peft=qlora: the adapted linears' weights in NF4


def _build(plan, layout: Layout, rank: int, lever: Lever | None = None) -> torch.nn.Module:
    """``plan``'s model for ``layout`` as fake rank ``rank`` builds it, on the meta device (with
    ``lever``: converted and in the precision it says)."""
    dims = layout.dims
    _on_fake_rank(dims.world_size, rank)
    spec = replace(plan.model, activation_checkpointing=layout.activation_checkpointing)
    spec = replace(spec, precision=lever.precision) if lever else spec
    meshes = dims.build_meshes("cpu")
    convert = _converter(plan, dims, lever.lora if lever else plan.lora)
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("meta"), convert=convert)
    return model


def micro_batches(step: Step, layout: Layout) -> int:
    """The step's micro-batches per dp rank: the pipeline's."""
    return step.global_batch_size // (layout.micro_batch_size * layout.dims.dp)


def plan_stages(plan, step: Step, layout: Layout) -> list[tuple[dict, MemoryEstimate]]:
    """Each pipeline rank's share (its layers, whether it holds the embedding and the head, the
    micro-batches it holds in flight) and its estimate, from one model built per rank (layers
    may differ in size or kind, e.g. Gemma 3n's MLPs, LFM2's conv and attention layers)."""
    config, world, pp = plan.model.config, plan.dims.world_size, layout.dims.pp
    schedule, per_rank, m = step.pp_schedule, step.pp_stages_per_rank, micro_batches(step, layout)
    stages = []
    for rank in range(pp):
        layers, first, last = rank_share(rank, pp, per_rank, config.num_hidden_layers)
        model = _build(plan, layout, rank * (world // pp))  # the fake rank at its pp coordinate
        flight = in_flight(schedule, pp, rank, m, per_rank)
        held = grads_held(schedule, pp, rank, m, per_rank)
        stage = Stage(layers=tuple(layers), last=last, in_flight=flight)
        stage = replace(stage, grads_held=held, pipelined=True)
        share = {"rank": rank, "stages": rank_stages(rank, pp, per_rank), "layers": len(layers)}
        share |= {"embedding": first, "head": last, "in_flight": flight, "grads_held": held}
        stages.append((share, estimate_memory(model, config, layout, step, stage)))
    return stages


def plan_layout(plan, step: Step, layout: Layout, lever: Lever | None = None) -> MemoryEstimate:
    """Build ``plan``'s model for ``layout`` on the meta device over the fake world (changed by
    ``lever``), and its frozen model beside it (DPO's reference, distillation's teacher); price
    them: the busiest pipeline rank's with pp > 1 (no recipe with a frozen model runs pp)."""
    if layout.dims.pp > 1:
        return busiest(plan_stages(plan, step, layout))[1]
    model, config = _build(plan, layout, 0, lever), plan.model.config
    step = replace(step, precision=lever.precision, nf4_base=lever.nf4_base) if lever else step
    return estimate_memory(model, config, layout, step, frozen=_frozen(plan, layout, lever))


def _frozen(plan, layout: Layout, lever: Lever | None = None) -> Frozen | None:
    """``plan``'s frozen model (``plan.frozen``) built for ``layout`` on the meta device, as the
    recipe builds it (``build_frozen_model``: its own TP plan, FSDP); None without one. Without a
    spec (or the trained model's own under a LoRA ``lever``) it is the trained model itself with
    its adapters off: no weights of its own."""
    frozen = plan.frozen
    if frozen is None:
        return None
    if frozen.spec is None or (lever and frozen.spec == plan.model):
        return Frozen(model=None, config=plan.model.config, keeps_hidden=frozen.keeps_hidden)
    meshes, meta = layout.dims.build_meshes("cpu"), torch.device("meta")
    spec = replace(frozen.spec, cpu_offload=plan.model.cpu_offload)  # train.cpu_offload: both
    model = build_frozen_model(spec, layout.dims, meshes, meta)
    return Frozen(model=model, config=spec.config, keeps_hidden=frozen.keeps_hidden)


def busiest(stages: list[tuple[dict, MemoryEstimate]]) -> tuple[dict, MemoryEstimate]:
    """The pipeline rank (share, estimate) of ``plan_stages`` with the largest total."""
    return max(stages, key=lambda stage: stage[1].total)


def _converter(
    plan, dims: ParallelDims, lora: LoraOptions | None
) -> Callable[[torch.nn.Module], torch.nn.Module] | None:
    """The recipe's conversion of the built model (``convert_model``) with ``lora``'s adapters,
    fp8's linears all-gathered in fp8 when ``dims`` shard over dp; None when nothing converts."""
    fp8 = plan.fp8
    if lora is None and fp8 is None:
        return None
    fp8 = fp8 and replace(fp8, data_parallel=dims.gathers_weights)
    return functools.partial(convert_model, lora=lora, fp8=fp8, seed=plan.seed)


def _candidates(plan, layout: Layout) -> list[tuple[str, Layout]]:
    """Changes that lower the memory: single ones first (cheapest first), then pairs, then all,
    each kept where the layout's rules (``components/distributed/layout.py``, those the recipe's
    checks ask: the model's sizes, its experts, the optimizer) let the run take it. A larger tp,
    cp or pp keeps the world: dp shrinks (its new size is named with the change)."""
    dims = layout.dims
    changes = []
    if layout.activation_checkpointing != "full":
        full = {"activation_checkpointing": "full"}
        changes.append([("train.activation_checkpointing=full", full)])
    micro = layout.micro_batch_size
    batches = [m for m in range(micro - 1, 0, -1) if micro % m == 0]
    changes.append([(f"train.micro_batch_size={m}", {"micro_batch_size": m}) for m in batches])
    changes += dims.changes()
    found = []
    for count in range(1, len(changes) + 1):
        for group in itertools.combinations(changes, count):
            for picks in itertools.product(*group):
                fields = {key: value for _, change in picks for key, value in change.items()}
                if candidate := _fitting(plan, layout, fields):
                    found.append((_words(picks, dims, candidate.dims), candidate))
    return found


def _fitting(plan, layout: Layout, fields: dict) -> Layout | None:
    """``layout`` with ``fields`` changed (degrees, the micro-batch, activation checkpointing), dp
    taking up the rest of the world, when it fits the run; else None."""
    own = {key: fields.pop(key) for key in _STEP_FIELDS if key in fields}  # the rest: degrees
    try:
        dims = layout.dims.changed(**fields)
    except LayoutError:
        return None
    candidate = replace(layout, dims=dims, **own)
    work = replace(plan.workload, micro_batch_size=candidate.micro_batch_size)
    found = dims.all_problems(work, plan.model_facts, plan.optimizer_facts)
    return None if found else candidate


def _words(picks: tuple, dims: ParallelDims, changed: ParallelDims) -> str:
    """A candidate as the overrides that make it: its changes, then dp, dp_replicate and dp_shard
    where they moved."""
    words = [word for word, change in picks if "dp_replicate" not in change]
    dp, replicas = changed.dp, changed.dp_replicate
    words += [f"dp={dp}"] * (dp != dims.dp)
    words += [f"dp_replicate={replicas}"] * (replicas != dims.dp_replicate)
    moved = dp != dims.dp or replicas != dims.dp_replicate
    words += [f"dp_shard={dp // replicas}"] * (moved and (replicas > 1 or dims.dp_replicate > 1))
    return " ".join(words)


def _suggest(plan, step: Step, layout: Layout, memory_gib: float) -> tuple[dict | None, list]:
    """The first candidate whose plan fits in ``memory_gib``; every candidate planned on the way
    (at most ``MAX_PLANNED``)."""
    tried = []
    for words, candidate in _candidates(plan, layout)[:MAX_PLANNED]:
        try:
            total = plan_layout(plan, step, candidate).total
        except ValueError as error:  # e.g. a TP plan the built model refuses: not a layout
            tried.append({"change": words, "error": str(error).split(";")[0]})
            continue
        tried.append({"change": words, "total_gib": round(total, 3), "fits": total <= memory_gib})
        if total <= memory_gib:
            return {"change": words, "total_gib": total}, tried
    return None, tried


# The optimizer-state levers (conf/optim/): the class, bits per moment value and values per
# scale; each offered where the layout's rules let it run (ParallelDims.optimizer_problems)
_STATE_LEVERS = {
    "optim=adamw8bit": ("torchao.optim.AdamW8bit", 8, 256),
    "optim=adamw4bit": ("torchao.optim.AdamW4bit", 4, 128),
}


def _state_levers(plan, step: Step, layout: Layout) -> list[dict]:
    """AdamW's state in 8 or 4 bits, each planned again at this layout: the memory per rank each
    gives (none for another optimizer, or one already quantized)."""
    if (
        step.optimizer_moments != 2
        or step.optimizer_bits
        or plan.optim.target != "torch.optim.AdamW"
    ):
        return []
    dims, levers = layout.dims, []
    for words, (target, bits, block) in _STATE_LEVERS.items():
        if dims.optimizer_problems(replace(plan.optimizer_facts, target=target), plan.workload):
            continue
        lowered = replace(step, optimizer_bits=bits, optimizer_block=block)
        levers.append({"change": words, "total_gib": plan_layout(plan, lowered, layout).total})
    return levers


def _offload_levers(plan, step: Step, layout: Layout, memory_gib: float) -> list[dict]:
    """``train.cpu_offload=true`` planned again at this layout, when it fits in ``memory_gib``:
    its device memory per rank and the host memory it needs (none on the CPU, where it moves
    nothing, for a run offloading already, or where the layout's rules refuse it: ep > 1)."""
    if step.device_type != "cuda" or step.cpu_offload:
        return []
    work = replace(plan.workload, cpu_offload=True)
    if layout.dims.all_problems(work, plan.model_facts, plan.optimizer_facts):
        return []
    offloading = replace(plan, model=replace(plan.model, cpu_offload=True))
    estimate = plan_layout(offloading, replace(step, cpu_offload=True), layout)
    if estimate.total > memory_gib:
        return []
    host = host_row(estimate.host, layout.dims.world_size)
    return [{"change": "train.cpu_offload=true", "total_gib": estimate.total, "host_gib": host}]


# peft=qlora as a lever for a run without adapters: conf/peft/qlora.yaml's (rank 8, alpha 16, the
# attention and MLP projections)
QLORA_LEVER = LoraOptions(rank=8, alpha=16.0, dropout=0.0, target_modules=None)


def _peft_levers(plan, step: Step, layout: Layout) -> list[dict]:
    """LoRA adapters on the frozen base (``peft=lora`` as it runs by default), at the run's
    precision and, where that keeps fp32 weights, in bf16 (``train.precision=bf16``: the base at
    2 bytes a weight), and ``peft=qlora`` (the run's adapters or :data:`QLORA_LEVER` on an NF4
    base), each planned again at this layout: the memory per rank each gives (none in fp8, which
    refuses adapters' levers; LoRA's none for a run with adapters already, QLoRA's none for a
    QLoRA run). Asked when no change of the layout fits."""
    if plan.fp8 is not None:
        return []
    levers = []
    lora = plan.lora_lever
    changes = {"peft=lora": step.precision, "peft=lora train.precision=bf16": "bf16"}
    for words, precision in changes.items() if lora is not None else ():
        if precision == step.precision and levers:
            continue  # the run is in bf16 already
        total = plan_layout(plan, step, layout, Lever(lora=lora, precision=precision)).total
        levers.append({"change": words, "total_gib": total})
    if not plan.model.nf4_base:
        qlora = Lever(lora=plan.lora or QLORA_LEVER, precision=step.precision, nf4_base=True)
        levers.append(
            {"change": "peft=qlora", "total_gib": plan_layout(plan, step, layout, qlora).total}
        )
    return levers


def _step(plan) -> Step:
    """The priced step: the run's workload, its widest micro-batch, precision and optimizer."""
    train, work = plan.train, plan.workload
    runtime = current_memory_gib("cpu") if plan.planned_device == "cpu" else 0.0
    bits, block = optimizer_state_bits(plan.optim.target, plan.optim.options())
    return Step(
        seq_len=widest_batch(plan.data.train, plan.pad_multiple),
        global_batch_size=work.global_batch_size,
        pp_schedule=work.pp_schedule,
        pp_stages_per_rank=work.pp_stages_per_rank,
        precision=train.precision,
        fp8_recipe=train.fp8_recipe,
        sequence_parallel=plan.model.sequence_parallel,
        rows_per_sample=plan.rows_per_sample,
        optimizer_moments=moments_of(plan.optim.target, plan.optim.options()),
        optimizer_bits=bits,
        optimizer_block=block,
        device_type=plan.planned_device,
        runtime_gib=runtime,
        cpu_offload=train.cpu_offload,
        loss_chunk_tokens=train.loss_chunk_tokens,
        # a dense mask over packed rows: sdpa's and eager's, not a packed-native kernel's
        packing=train.packing and plan.model.config._attn_implementation not in PACKED_NATIVE,
        nf4_base=plan.model.nf4_base,
    )


def _device_memory_gib(asked: float | None) -> float | None:
    if asked is None and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return asked


class UnbuildableLayout(ValueError):
    """The dry run's model cannot be built at the asked layout: the error a launch would hit."""


def dry_run(plan) -> dict:
    """Plan ``plan`` (a checked ``recipes.plan.RunPlan``) on fake ranks; print it, write plan.json.

    Raises:
        UnbuildableLayout: One line, where the model cannot be built at the asked layout.
    """
    dims, train = plan.dims, plan.train
    ac, micro = train.activation_checkpointing, train.micro_batch_size
    layout = Layout(dims=dims, micro_batch_size=micro, activation_checkpointing=ac)
    step = _step(plan)
    memory = _device_memory_gib(plan.device_memory_gib)
    try:
        try:
            stages = plan_stages(plan, step, layout) if layout.dims.pp > 1 else []
            estimate = busiest(stages)[1] if stages else plan_layout(plan, step, layout)
        except (ValueError, RuntimeError) as error:
            why = f"dry run: the model cannot be built for this layout: {error}"
            raise UnbuildableLayout(why) from None
        fits = None if memory is None else estimate.total <= memory
        suggestion, tried = _suggest(plan, step, layout, memory) if fits is False else (None, [])
        asked = fits is False and not stages  # the levers, at this layout
        levers = _state_levers(plan, step, layout) if asked else []
        offload = _offload_levers(plan, step, layout, memory) if asked else []
        unfit = asked and suggestion is None  # no layout change fits
        peft = _peft_levers(plan, step, layout) if unfit else []
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result = {
        "world_size": dims.world_size,
        "layout": _layout_row(layout),
        "seq_len": train.seq_len,
        "batch_positions": step.seq_len,  # the widest micro-batch the data makes
        "precision": train.precision,
        "per_rank_gib": {row: getattr(estimate, row) for row in ROWS},
        "device": step.device_type,
        "cpu_offload": step.cpu_offload,
        "host_gib": host_row(estimate.host, dims.world_size) if estimate.host_detail else None,
        "host_detail_gib": estimate.host_detail,
        "detail_gib": estimate.detail,
        "phases_gib": estimate.phases,
        "flops_per_token": known_flops_per_token(plan.model.config, train.seq_len),
        "pipeline": _pipeline(step, layout, stages) if stages else None,
        "per_stage_gib": [_stage_row(share, e) for share, e in stages],
        "device_memory_gib": memory,
        "fits": fits,
        "suggestion": suggestion,
        "tried": tried,
        "optimizer_levers": levers,
        "offload_levers": offload,
        "peft_levers": peft,
    }
    _write(plan.output_dir, result)
    return result


def _pipeline(step: Step, layout: Layout, stages: list) -> dict:
    """The schedule's figures: micro-batches per step, the bubble, the busiest pipeline rank."""
    m, per_rank = micro_batches(step, layout), step.pp_stages_per_rank
    worst = busiest(stages)[0]["rank"]
    return {
        "pp": layout.dims.pp,
        "schedule": step.pp_schedule,
        "stages_per_rank": per_rank,
        "micro_batches": m,
        "bubble": bubble(step.pp_schedule, layout.dims.pp, m, per_rank),
        "busiest_rank": worst,
    }


def _layout_row(layout: Layout) -> dict:
    """plan.json's layout: the degrees (dp: HSDP's pair's product), the micro-batch, activation
    checkpointing, sp."""
    dims = layout.dims
    row = {"tp": dims.tp, "dp": dims.dp, "ep": dims.ep, "micro_batch_size": layout.micro_batch_size}
    row |= {"cp": dims.cp, "dp_replicate": dims.dp_replicate, "pp": dims.pp}
    return row | {"activation_checkpointing": layout.activation_checkpointing, "sp": dims.sp}


def _stage_row(share: dict, estimate: MemoryEstimate) -> dict:
    return {**share, **{row: getattr(estimate, row) for row in STAGE_ROWS}}


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
    pp = f"pp {layout['pp']} × " if layout.get("pp", 1) > 1 else ""
    lines = [
        f"dry run: world {result['world_size']} = {pp}dp {dp}{hsdp} × cp {layout['cp']} "
        f"× tp {layout['tp']} "
        f"(ep {layout['ep']}, sp {str(layout['sp']).lower()}), "
        f"micro-batch {layout['micro_batch_size']} "
        f"× seq {result['seq_len']}, {result['precision']}, activation checkpointing "
        f"{layout['activation_checkpointing']}",
    ]
    positions = result["batch_positions"]
    if positions < result["seq_len"]:
        lines.append(
            f"  the data's longest row pads a micro-batch to {positions} positions at most: "
            "planned for that"
        )
    lines.append(f"per rank (GiB, the busiest rank, planned for {result['device']}):")
    per_rank = result["per_rank_gib"]
    lines += [
        f"  {row:<12}{per_rank[row]:>10.3f}" for row in ROWS if row != "frozen" or per_rank[row]
    ]
    detail = result["detail_gib"].items()
    lines += [f"    {name:<34}{value:>8.3f}" for name, value in detail if value]
    flops = result["flops_per_token"]
    known = f"{flops:.4g} (forward + backward, no recompute)" if flops else "unknown: no sizes"
    lines.append(f"flops_per_token {known}")
    lines += _offload_lines(result)
    if result.get("pipeline"):
        lines += _format_stages(result)
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
    for lever in result["optimizer_levers"] + result["peft_levers"]:
        fits_too = "fits" if lever["total_gib"] <= memory else "does not fit"
        lines.append(f"  {lever['change']}: {lever['total_gib']:.2f} GiB per rank ({fits_too})")
    for lever in result["offload_levers"]:  # each fits
        lines.append(
            f"  {lever['change']}: {lever['total_gib']:.2f} GiB per rank on the device (fits), "
            f"{host_words(lever['host_gib'])}"
        )
    return "\n".join(lines)


def _offload_lines(result: dict) -> list[str]:
    """What ``train.cpu_offload=true`` moves in the plan: the host memory it needs on CUDA;
    nothing on the CPU."""
    if not result["cpu_offload"]:
        return []
    if result["host_gib"] is None:
        return [OFFLOAD_ON_THE_CPU]
    return [f"train.cpu_offload=true: {host_words(result['host_gib'])}"]


def _format_stages(result: dict) -> list[str]:
    """The pipeline's lines: the schedule and its bubble, then one row per pipeline rank."""
    pipeline = result["pipeline"]
    interleaved = pipeline["stages_per_rank"] > 1
    looped = f", {pipeline['stages_per_rank']} stages per rank" if interleaved else ""
    lines = [
        f"pipeline: {pipeline['schedule']}{looped}, {pipeline['micro_batches']} micro-batches per "
        f"step, bubble {pipeline['bubble']:.1%}; per pipeline rank (GiB):",
        "  rank  layers  holds            in flight" + "".join(f"{row:>12}" for row in STAGE_ROWS),
    ]
    for row in result["per_stage_gib"]:
        holds = "+".join(name for name in ("embedding", "head") if row[name]) or "-"
        figures = "".join(f"{row[name]:>12.3f}" for name in STAGE_ROWS)
        lines.append(
            f"  {row['rank']:>4}  {row['layers']:>6}  {holds:<15}{row['in_flight']:>10.3g}{figures}"
        )
    return lines
