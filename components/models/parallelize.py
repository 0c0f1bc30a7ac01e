"""Build the model a rank trains, in the one fixed order every parallelism needs.

    weights in the precision's dtype (seeded, or on the meta device) -> converted (LoRA) -> with
    pp, this rank's pipeline stage kept -> TP plan (+ bf16 casts ahead of its gathers) -> expert
    parallelism -> load this rank's slices -> QLoRA's NF4 base -> compile and activation
    checkpointing per block -> FSDP over dp (dp × cp) with the precision's mixed-precision
    policy (with train.cpu_offload, its offload policy at any dp) -> with cp > 1, the
    context-parallel attention -> with a flash kernel, the rows' sequence boundaries passed on

Each step is its own component (``tp_plan``, ``moe``, ``load``, ``fsdp``); this module only fixes
their order, so the recipe makes one call.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from components.distributed.context_parallel import enable_context_parallel
from components.distributed.fsdp import shard_data_parallel
from components.distributed.layout import Meshes, ParallelDims
from components.distributed.pipeline import keep_rank_stage, stage_plan
from components.distributed.tp_dropout import has_dropout, shard_dropout_masks
from components.distributed.tp_plan import PlanReport, apply_tp_plan
from components.models.attention import pass_sequence_boundaries
from components.models.build import build_causal_lm, meta_causal_lm
from components.models.compile import apply_block_wrappers
from components.models.derived_plan import derived_plan_note
from components.models.families import (
    expert_entries,
    plan_for,
    plan_is_derived,
    unbuilt_patterns,
)
from components.models.load import materialize_pretrained
from components.models.precision import PrecisionPolicy, precision_policy
from components.models.qlora import quantize_base
from components.moe import apply_expert_parallel


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What to build: the config, where its weights come from, and how it is split."""

    config: PretrainedConfig
    weights: Path | None  # a Hugging Face folder, or None for seeded random weights
    seed: int
    sequence_parallel: bool
    experts: tuple[str, ...]  # module patterns of MoE experts and routers (left out of the TP plan)
    routers: tuple[str, ...]
    precision: str  # fp32 | bf16-mixed | bf16 | fp8 (components.models.precision)
    activation_checkpointing: str  # none | full | selective
    compile: bool  # torch.compile each decoder block
    shard_experts: bool = False  # moe.shard_experts: expert weights also Shard(1) over ep_shard
    pp_stages_per_rank: int = 1  # pipeline stages each pp rank holds (interleaved schedules: 2+)
    nf4_base: bool = False  # peft=qlora: the adapted linears' weights stored in NF4 once loaded
    cpu_offload: bool = False  # train.cpu_offload: FSDP2's offload policy (FSDP at dp=1 too)


def build_parallel_model(
    spec: ModelSpec,
    dims: ParallelDims,
    meshes: Meshes,
    device: torch.device,
    convert: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[nn.Module, PlanReport | None]:
    """The model of this rank, split over ``meshes`` (``dims.build_meshes``: TP over
    ``meshes.world["tp"]``, experts over ``meshes.experts``, FSDP over ``meshes.fsdp``), and the
    TP plan's report (None at tp=1). On the meta ``device`` (a dry run) every step runs but
    nothing gets storage. ``convert``: applied to the built model before it is parallelised
    (where LoRA adapters and FP8 linears plug in)."""
    policy = precision_policy(spec.precision)
    if spec.weights is None and device.type != "meta":
        model = build_causal_lm(spec.config, seed=spec.seed, dtype=policy.param_dtype).to(device)
    else:  # nothing allocated until each rank loads its own shards
        model = meta_causal_lm(spec.config, dtype=policy.param_dtype)
    model = convert(model) if convert is not None else model
    mesh = meshes.world
    if dims.pp > 1:  # this rank's pipeline stage alone, its parameters named as in the whole
        model = keep_rank_stage(model, mesh, spec.pp_stages_per_rank)
    report = _split_by_tp(model, spec, dims, mesh, policy, device) if dims.tp > 1 else None
    if dims.ep > 1:
        experts = list(spec.experts)
        apply_expert_parallel(
            model, meshes.experts, mesh["tp"], experts, shard_experts=spec.shard_experts
        )
    if device.type != "meta":
        _load(model, spec, device)
    apply_block_wrappers(model, spec.activation_checkpointing, spec.compile)
    if dims.fsdp_wraps(spec.cpu_offload):  # dp × cp > 1 (the cp ranks hold the same weights)
        shard_data_parallel(
            model, meshes.fsdp, mp_policy=policy.fsdp_policy(), cpu_offload=spec.cpu_offload
        )
    if dims.cp > 1:
        enable_context_parallel(model)
    pass_sequence_boundaries(model)  # a flash kernel: each forward passes its rows' sequences
    return model, report


def _split_by_tp(
    model: nn.Module,
    spec: ModelSpec,
    dims: ParallelDims,
    mesh,
    policy: PrecisionPolicy,
    device: torch.device,
) -> PlanReport:
    """The model's TP plan (this pipeline stage's entries with pp) applied over ``mesh["tp"]``,
    its notes (a derived plan, experts left to expert parallelism, entries this config does not
    build), the bf16 casts ahead of TP's gathers, and dropout masks sharded with the activations."""
    plan = plan_for(spec.config, spec.sequence_parallel, model)
    plan = stage_plan(plan, model) if dims.pp > 1 else plan  # this stage's modules' entries
    moe_modules = (*spec.experts, *spec.routers)
    report = apply_tp_plan(
        model, mesh["tp"], plan, spec.config, spec.sequence_parallel, moe_modules
    )
    if plan_is_derived(spec.config):
        report.notes.append(derived_plan_note(spec.config, plan))
    if entries := expert_entries(spec.config, model):
        where = (
            f"whole experts split over ep={dims.ep}"
            if dims.ep > 1
            else "at ep=1 every expert on every TP rank, gradient mean"
        )
        report.notes.append(
            f"the model's own plan for its experts ({', '.join(entries)}) is replaced by "
            f"expert parallelism: {where}"
        )
    if unbuilt := unbuilt_patterns(spec.config, model):
        report.notes.append(
            f"the model's own plan names layers this config does not build, ignored: "
            f"{', '.join(unbuilt)}"
        )
    policy.cast_tp_inputs(model, fsdp=dims.fsdp_wraps(spec.cpu_offload))
    if has_dropout(model):
        shard_dropout_masks(model, mesh["tp"], spec.sequence_parallel, device)
    return report


def _load(model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """This rank's slices of the pretrained weights (seeded ones are there already), then with
    ``peft=qlora`` the adapted linears' base quantized to NF4 (components/models/qlora.py)."""
    if spec.weights is not None:
        materialize_pretrained(model, spec.weights, device=str(device))
    if spec.nf4_base:
        quantize_base(model)
