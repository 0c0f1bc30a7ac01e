"""What the checks decided (:class:`Checked`, pure), the run plan the ``prepare`` phase makes of
it (:class:`RunPlan`: every decision of a run, made once and read by every rank), and what a rank
builds from the plan (:class:`Run`).

Ranks never re-derive what is here (paths, sizes, the checkpoint to resume, the data, the model's
config). The settings themselves stay the schema's object (``recipes/schema.py``, each key declared
once there); the plan adds only what was decided from them.
"""

from __future__ import annotations  # the field types are only read by a type checker

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from components.distributed.layout import (
    Degrees,
    ModelFacts,
    OptimizerFacts,
    ParallelDims,
    Workload,
    tp_sizes,
)
from components.models.families import moe_patterns
from components.models.options import LoraTargets, ModelChoice, ModelUse
from components.training.cadence import Cadence
from recipes.schema import Checkpoint, Config, Moe, Optim, Peft, Schedule, Targeted, Train

CONF = Path(__file__).resolve().parents[1] / "conf"

if TYPE_CHECKING:  # heavy (datasets, DTensor): the checks import them when they need them
    import torch

    from components.checkpoint.state import TrainState
    from components.data import PreparedData, StepBatches
    from components.data.sources import DataSource
    from components.debug.faults import Fault
    from components.distributed.context_parallel import ContextParallel
    from components.distributed.layout import Meshes
    from components.distributed.pipeline import Pipeline
    from components.distributed.step_finalizer import StepFinalizer
    from components.models.fp8 import Fp8Options
    from components.models.lora import LoraOptions
    from components.models.parallelize import ModelSpec
    from components.moe import ExpertLoad
    from components.training.readout import StepReadout


@dataclass(frozen=True, kw_only=True)
class FrozenModel:
    """A frozen model a recipe runs forward beside the trained one, as the dry run prices it:
    DPO's reference or distillation's teacher (``components/models/frozen.py``). ``spec`` None:
    the trained model itself with its adapters off (peft=lora's reference, no second copy);
    ``keeps_hidden``: its last hidden states live through the trained model's step (the KL's)."""

    spec: ModelSpec | None
    keeps_hidden: bool


@dataclass(frozen=True, kw_only=True)
class Settled:
    """The validated settings (train.* decided: warmup_steps cut to max_steps, with a note:, and
    loss_chunk_tokens 0 for off) and what follows from them alone."""

    settings: Config
    dims: ParallelDims  # the mesh's sizes: pp × dp_replicate × dp_shard × cp × tp, as data
    device_type: str  # "cpu" or "cuda"
    cpu_threads: int  # intra-op threads per rank on the CPU
    output_dir: Path  # absolute; this run owns it while it runs
    fault: Fault | None  # debug.fault, parsed: a resilience drill (docs/fault-injection.md)
    config_yaml: str  # the resolved config the run was started with (output_dir/config.yaml)
    # what the layout's rules read of the model, as its checks found it (None: not checked yet,
    # a folder still to be fetched)
    model_facts: ModelFacts | None = None

    @property
    def train(self) -> Train:
        return self.settings.train

    @property
    def optim(self) -> Optim:
        return self.settings.optim

    @property
    def schedule(self) -> Schedule:
        return self.settings.schedule

    @property
    def checkpoint(self) -> Checkpoint:
        return self.settings.checkpoint

    @property
    def logger(self) -> Targeted:
        return self.settings.logger

    @property
    def moe(self) -> Moe:
        return self.settings.moe

    @property
    def optimizer_facts(self) -> OptimizerFacts:
        """What the layout's rules read of the optimizer."""
        return optimizer_facts(self.settings)

    @property
    def workload(self) -> Workload:
        """What the layout splits and composes with: the step's batch geometry and settings."""
        return workload(self.settings)

    @property
    def lora(self) -> LoraOptions | None:
        """``peft=lora``'s (and ``qlora``'s) options as the model takes them; None for full
        fine-tuning."""
        peft = self.settings.peft
        if not peft.adapters:
            return None
        return lora_options(peft, self.model.experts if peft.experts else ())

    @property
    def lora_lever(self) -> LoraOptions | None:
        """LoRA's options as ``peft=lora`` runs by default (``conf/peft/lora.yaml``'s values):
        the dry run's lever for a full fine-tuning run; None for a run with adapters already."""
        if self.settings.peft.name != "none":
            return None
        values = OmegaConf.to_container(OmegaConf.load(CONF / "peft" / "lora.yaml"))
        return lora_options(type(self.settings.peft)(**values), ())

    @property
    def pipeline(self) -> tuple[str, int]:
        """The pipeline schedule and the stages each pp rank holds."""
        return self.settings.pp_schedule, self.settings.pp_stages_per_rank

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def dry_run(self) -> bool:
        return self.settings.dry_run

    @property
    def device_memory_gib(self) -> float | None:
        return self.settings.device_memory_gib

    @property
    def planned_device(self) -> str:
        """The device type a dry run plans for: ``dry_run_device``, else this machine's."""
        return self.settings.dry_run_device or self.device_type

    @property
    def collective_timeout(self) -> timedelta:
        return timedelta(minutes=self.settings.collective_timeout_minutes)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def last_step(self) -> int:
        """The last step this invocation trains: ``train.stop_after`` or ``train.max_steps``."""
        return min(self.train.max_steps, self.train.stop_after or self.train.max_steps)


@dataclass(frozen=True, kw_only=True)
class Checked(Settled):
    """What the pure checks found: the model and data as checked, before anything is prepared."""

    model_path: Path | None  # the weights' folder, or None: built from its config
    model_config: Any  # the Hugging Face config (its vocabulary not yet a trained tokenizer's)
    source: DataSource
    model_awaits_fetch: bool = (
        False  # a Hub download or SmolLM2's conversion: prepare's, then checked
    )


@dataclass(frozen=True, kw_only=True)
class RunPlan(Settled):
    """The frozen plan every rank reads: the checked settings and what ``prepare`` made."""

    model: ModelSpec  # the Hugging Face config (vocabulary size included), weights, how to split
    tokenizer_dir: Path
    data: PreparedData  # the tokenized splits, prepared once, memory-mapped by the ranks
    pad_multiple: int | None  # a micro-batch padded to its longest row rounded up; None: seq_len
    resume_from: Path | None  # the checkpoint chosen before any rank started, or None
    run_id: str | None  # this run's id (checkpoints record it); None in a dry run
    # what checkpoints record and a resume must match (model shapes, optimizer, batch geometry)
    run_info: dict

    @property
    def reduce_each_micro_batch(self) -> bool:
        """Offloaded, FSDP reduce-scatters every micro-batch's gradients into the host's shards
        (accumulated unsharded, they would fill the device memory the offload frees; the memory
        model counts none for it)."""
        return self.model.cpu_offload

    @property
    def fsdp_wraps(self) -> bool:
        """Whether FSDP wraps the model: dp × cp > 1, or offloaded (``ParallelDims.fsdp_wraps``)."""
        return self.dims.fsdp_wraps(self.model.cpu_offload)

    @property
    def fp8(self) -> Fp8Options | None:
        """``train.precision=fp8``'s options as the model takes them; None in other precisions."""
        from components.models.fp8 import Fp8Options

        if self.train.precision != "fp8":
            return None
        excluded = (*self.model.experts, *self.model.routers)
        emulate = self.device_type == "cpu"  # its float8 matmul is a slow reference kernel
        gathers = self.dims.gathers_weights
        options = dict(recipe=self.train.fp8_recipe, data_parallel=gathers, emulate=emulate)
        return Fp8Options(**options, excluded=excluded)

    @property
    def title(self) -> str:
        """The run in a line (``loss.png``'s title): the model, the degrees above 1, the run's
        length and its folder."""
        degrees = {name: getattr(self.dims, name) for name in ("pp", "dp", "cp", "tp", "ep")}
        layout = " ".join(f"{name}={n}" for name, n in degrees.items() if n > 1) or "one rank"
        model, steps = self.settings.model.name, self.train.max_steps
        return f"{model}, {layout}, {steps} steps: {self.output_dir.name}"

    @property
    def rows_per_sample(self) -> int:
        """Rows of a micro-batch per sample: 2 for preference pairs (chosen, rejected), else 1."""
        return 2 if self.settings.preference_pairs else 1

    @property
    def frozen(self) -> FrozenModel | None:
        """The frozen model run forward beside the trained one (none: fine-tuning)."""
        return None

    @cached_property
    def flops_per_token(self) -> int | None:
        """Model FLOPs of forward + backward per token at ``train.seq_len`` (for ``mfu``); None
        where the config lacks the sizes the count reads."""
        from components.planning.flops import known_flops_per_token

        return known_flops_per_token(self.model.config, self.train.seq_len)

    @property
    def cadence(self) -> Cadence:
        """When the loop validates (never without held-out data), saves, checks the TP replicas and
        stops."""
        validate_every = self.train.val_every if self.data.val is not None else 0
        return Cadence(
            max_steps=self.train.max_steps,
            last_step=self.last_step,
            validate_every=validate_every,
            save_every=self.checkpoint.every_steps,
            check_replicas_every=self.settings.debug.check_replicas_every,
        )


@dataclass(frozen=True, kw_only=True)
class DpoChecked(Checked):
    """``recipes/dpo.py``'s checks: fine-tuning's, and ``dpo.reference_path`` as checked: its
    folder and Hugging Face config (both None: the reference is the policy's starting weights)."""

    reference_path: Path | None
    reference_config: Any  # None while reference_awaits_fetch
    # the policy is still to be downloaded or converted: the preparation fetches it, then checks
    # the reference folder against it
    reference_awaits_fetch: bool = False


@dataclass(frozen=True, kw_only=True)
class DpoPlan(RunPlan):
    """``recipes/dpo.py``'s plan: fine-tuning's, and the frozen reference to build on the
    policy's meshes: the policy's starting weights' spec, or None with ``peft=lora`` (the policy
    with its adapters off)."""

    reference: ModelSpec | None

    @property
    def frozen(self) -> FrozenModel:
        return FrozenModel(spec=self.reference, keeps_hidden=False)


@dataclass(frozen=True, kw_only=True)
class DistillChecked(Checked):
    """``recipes/distill.py``'s checks: the student's (the ``model`` group) and the teacher as
    checked: its folder (None: built from ``teacher.config``) and Hugging Face config; both None
    while ``teacher_awaits_fetch``."""

    teacher_path: Path | None
    teacher_config: Any  # a built teacher's vocabulary: the student's, set in preparation
    # the student or the teacher is still to be downloaded or converted: the preparation fetches
    # both, then checks the teacher
    teacher_awaits_fetch: bool = False


@dataclass(frozen=True, kw_only=True)
class DistillPlan(RunPlan):
    """``recipes/distill.py``'s plan: fine-tuning's, and the frozen teacher to build on the
    student's meshes (its own TP plan, the student's vocabulary)."""

    teacher: ModelSpec

    @property
    def frozen(self) -> FrozenModel:
        return FrozenModel(spec=self.teacher, keeps_hidden=True)


@dataclass(kw_only=True)
class Run:
    """One rank's handles: where it is, what it trains, and with what."""

    rank: int
    device: torch.device
    meshes: Meshes  # by purpose: the world's dimensions, the batch's, the loss's, FSDP's, experts'
    state: TrainState  # what a checkpoint saves: model, optimizer, schedule, step
    data: StepBatches
    val_data: StepBatches | None
    val_sources: dict[str, StepBatches]  # a mixture's sources' validation splits; {} for one source
    first_step: int  # steps already done when this launch started (by the checkpoint resumed)
    compute: Callable[[], AbstractContextManager]  # the precision's forward context (autocast)
    experts: ExpertLoad | None  # tokens per expert of an MoE model, for the step's imbalance
    aux_loss_weight: float  # of an MoE model's load-balancing loss (0: its config has none)
    cp: ContextParallel | None  # this rank's context-parallel group (None at cp=1)
    finalize_gradients: StepFinalizer  # each DTensor gradient given its parameter's placements
    readout: StepReadout  # the step's values read on the host before the update, at once
    pipeline: Pipeline | None = None  # this rank's pipeline stage and schedule (pp > 1)
    # train.cpu_offload: FSDP reduce-scatters every micro-batch's gradients into the host's shards
    # (accumulated unsharded, they would fill the device memory the offload frees)
    reduce_each_micro_batch: bool = False
    before_commit: Callable[[Path], None] | None = None  # the writer's callback (a drill's)


StepFn = Callable[[Run, "RunPlan", int], "torch.Tensor"]  # a step's forward and backward: its sums
# the step's loss metrics from the step function's sums, as read on the host
RecordFn = Callable[[Run, "RunPlan", int, Any], dict]
# the validation metrics where the cadence validates (val_loss, a recipe's own), alike on each rank
ValidateFn = Callable[[Run, "RunPlan"], dict]


@dataclass(frozen=True, kw_only=True)
class RecipeSteps:
    """What a recipe's loop runs (fine-tuning's, DPO's, distillation's): each step's forward and
    backward (``step``), the step's loss metrics from its sums (``record``), and the validation
    metrics where the cadence validates (``validate``)."""

    step: StepFn
    record: RecordFn
    validate: ValidateFn


# a recipe's steps for a rank's run, built once the run is set up (DPO's reference on its meshes)
StepsOf = Callable[[Run, "RunPlan"], RecipeSteps]


def lora_options(peft: Peft, experts: Sequence[str]) -> LoraOptions:
    """The ``peft`` section of ``peft=lora`` as the model takes it, ``experts`` the resolved
    patterns of the experts that get adapters (none without ``peft.experts``)."""
    from components.models.lora import LoraOptions  # DTensor, transformers: design-notes.md

    patterns = None if peft.target_modules is None else tuple(peft.target_modules)
    return LoraOptions(
        rank=peft.rank,
        alpha=peft.alpha,
        dropout=peft.dropout,
        target_modules=patterns,
        experts=tuple(experts),
    )


def workload(settings: Config) -> Workload:
    """What the layout splits and composes with, from the settings: the step's batch geometry,
    ``train.compile`` and the pipeline schedule."""
    train = settings.train
    return Workload(
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        seq_len=train.seq_len,
        compile=train.compile,
        fp8=train.precision == "fp8",
        pp_schedule=settings.pp_schedule,
        pp_stages_per_rank=settings.pp_stages_per_rank,
        cpu_offload=train.cpu_offload,
    )


def model_facts(
    settings: Config,
    config: Any,
    routed_experts: str | None = None,
    refusals: Mapping[tuple[str, int], tuple[str, ...]] | None = None,
    other_layouts: Sequence[tuple[str, int]] = (),
) -> ModelFacts:
    """What the layout rules read of the model of ``config`` (its Hugging Face config), whose
    experts called with tokens already routed are ``routed_experts`` (``components.moe.checks``,
    from the meta model) and which the model's checks refuse at other degrees with ``refusals``
    (``components.models.checks``), the recipe's own at ``other_layouts`` added."""
    model = settings.model
    experts, _ = moe_patterns(config, model.experts, model.routers)
    refusals = with_recipe_refusals(settings, refusals or {}, other_layouts)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)  # BLT's config has none
    return ModelFacts(
        name=model.name,
        moe=bool(experts),
        layers=layers,
        tp_sizes=tp_sizes(config),
        routed_experts=routed_experts,
        refusals=refusals,
    )


def with_recipe_refusals(
    settings: Config,
    refusals: Mapping[tuple[str, int], tuple[str, ...]],
    other_layouts: Sequence[tuple[str, int]],
) -> dict[tuple[str, int], tuple[str, ...]]:
    """``refusals`` and, at each of ``other_layouts`` (a degree and its size a dry run may
    suggest), the line of a degree the recipe does not run there (``Config.refused_degree``:
    DPO's cp and pp), so that the dry run suggests none of them."""
    found = dict(refusals)
    for name, size in other_layouts:
        if line := settings.refused_degree(name, size):
            found[(name, size)] = (*found.get((name, size), ()), line)
    return found


def optimizer_facts(settings: Config) -> OptimizerFacts:
    """What the layout rules read of the ``optim`` group: its class and ``foreach`` as given."""
    return OptimizerFacts(
        target=settings.optim.target, foreach=settings.optim.options().get("foreach")
    )


def degrees(settings: Config) -> Degrees:
    """The degrees the settings ask for (``dp`` and ``dp_shard`` null: from the world)."""
    sizes = dict(pp=settings.pp, dp=settings.dp, dp_replicate=settings.dp_replicate)
    sizes |= dict(dp_shard=settings.dp_shard, cp=settings.cp, tp=settings.tp, ep=settings.ep)
    return Degrees(**sizes, sp=settings.sp)


def model_choice(settings: Config) -> ModelChoice:
    """The ``model`` group as the model's checks read it (the same keys), and ``cache_dir``, where
    ``model.source=smollm2`` is converted."""
    cache_dir = Path(settings.cache_dir).expanduser().absolute()
    return ModelChoice(**settings.model.model_dump(), cache_dir=cache_dir)


def model_use(settings: Config, device_type: str, dims: ParallelDims | None = None) -> ModelUse:
    """What the run asks of the model: its sequence, precision, compile, device and adapters
    (none when ``peft``'s own keys are refused); in a dry run at ``dims``, the larger degrees it
    may suggest, whose refusals the model's checks find too."""
    peft, train = settings.peft, settings.train
    targets = None if peft.target_modules is None else tuple(peft.target_modules)
    lora = LoraTargets(target_modules=targets, experts=bool(peft.experts), merged=peft.merge)
    return ModelUse(
        seq_len=train.seq_len,
        sequence_parallel=settings.sp,
        precision=train.precision,
        compile=train.compile,
        device_type=device_type,
        lora=lora if peft.adapters and not peft.errors() else None,
        peft_lora=peft.adapters,
        nf4_base=peft.name == "qlora",
        packing=train.packing,
        other_layouts=_other_layouts(dims) if settings.dry_run and dims else (),
    )


def _other_layouts(dims: ParallelDims) -> tuple[tuple[str, int], ...]:
    """The degrees a dry run may suggest on the world of ``dims`` (``ParallelDims.changes``):
    each larger tp, cp and pp, fewer HSDP replicas."""
    changes = [change for group in dims.changes() for _, change in group]
    return tuple((name, size) for change in changes for name, size in change.items())
