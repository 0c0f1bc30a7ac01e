"""The config's declared schema, the one declaration of every key: its type, range or choices
(each list of choices named once, its hint made from it), its meaning, and what to write instead.

Pydantic v2 models over the composed, resolved config (not Hydra structured configs) because the
checks need to collect *every* problem at once with its location, and pydantic reports all errors of
a validation in one exception, each with its dotted path and the offending input; a Hydra structured
config stops at the first. Models are strict (no "2" -> 2, no true -> 1), frozen, and forbid extra
keys, so a key added with ``+`` that nothing reads is an error. No field has a default: defaults
live in ``conf/`` as values only, so a key deleted from the composition is an error too. Each
field's ``description`` is the hint printed after "use ...", its comment what the key means.

Groups chosen by ``_target_`` (``optim``, ``data``, ``logger``) declare only their shared keys here;
their other keys are checked against the signature of the class the target names (see
``recipes/checks.py``).
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from components.models.options import (
    ACTIVATION_CHECKPOINTING,
    ATTENTION_IMPLEMENTATIONS,
    FP8_RECIPES,
    OFFLOAD_ON_THE_CPU,
    PRECISIONS,
)
from components.problems import Problem, problems, show
from components.targets import check_target
from components.training.loggers import check_logger_available, check_logger_options

if TYPE_CHECKING:  # the layout imports DeviceMesh: --help and --cfg job stay light
    from components.distributed.layout import ParallelDims

ON_NONFINITE = ("stop", "skip")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # components.checkpoint.export's names
EXPERT_LOADS = ("layers", "experts")
MODEL_SOURCES = ("smollm2",)
LOSS_ON = ("all_assistant", "last_assistant")  # components/data/collate.py's two labellings
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # components/distributed/pipeline.py
DEVICE_TYPES = ("cuda", "cpu")  # what a dry run may plan for


def one_of(values: tuple[str, ...], null: str | None = None) -> str:
    """The hint of a key that takes one of ``values`` (or null, meaning ``null``), from the same
    tuple its type is made of."""
    listed = ", ".join(values)
    return f"null ({null}) or one of {listed}" if null else f"one of {listed}"


def key(hint: str, common: str | None = None, **constraints: Any) -> Any:
    """A required field whose ``hint`` says what would work, e.g. "a positive integer, e.g.
    tp=2"; ``common``: what the key sets, for a key most runs touch (``--help`` lists those)."""
    extra = {COMMON: common} if common else None
    return Field(description=hint, json_schema_extra=extra, **constraints)


COMMON = "common"  # the json_schema_extra entry of a key most runs touch: what it sets


PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1, pattern=r"\S")]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Train(Section):
    max_steps: PositiveInt = key("a positive integer, e.g. train.max_steps=60", "optimizer steps")
    # end this invocation after this step (the schedule spans max_steps) with a checkpoint of it,
    # even with every_steps=0: resume=auto goes on
    stop_after: PositiveInt | None = key("null or a positive step number, e.g. train.stop_after=20")
    global_batch_size: PositiveInt = key(
        "a positive integer, e.g. train.global_batch_size=16", "sequences per optimizer step"
    )
    micro_batch_size: PositiveInt = key(
        "a positive integer, e.g. train.micro_batch_size=8",
        "sequences per forward pass per dp rank (the rest accumulates)",
    )
    seq_len: Annotated[int, Field(ge=2)] = key(
        "an integer of at least 2, e.g. train.seq_len=48", "tokens per sequence"
    )
    clip_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = key(
        "null (no clipping) or a positive number, e.g. train.clip_grad_norm=1.0",
        "the global grad norm is clipped to this",
    )
    val_every: Count = key(
        "0 (never) or a positive number of steps, e.g. train.val_every=20",
        "steps between validation losses (and after the last step); 0: never",
    )
    warmup_steps: Count = key(
        "0 or a positive number of steps, e.g. train.warmup_steps=5", "learning-rate warmup steps"
    )
    # a non-finite grad norm stops the run, or skips the update
    on_nonfinite: Literal[ON_NONFINITE] = key(one_of(ON_NONFINITE))
    # bf16-mixed: fp32 master weights, bf16 compute; bf16: everything bf16; fp8: bf16-mixed with
    # the decoder's linear layers in torchao float8
    precision: Literal[PRECISIONS] = key(one_of(PRECISIONS), "fp32, bf16-mixed, bf16 or fp8")
    # fp8's scaling: one scale per tensor, or per row (read with precision=fp8 only)
    fp8_recipe: Literal[FP8_RECIPES] = key(one_of(FP8_RECIPES))
    activation_checkpointing: Literal[ACTIVATION_CHECKPOINTING] = key(
        one_of(ACTIVATION_CHECKPOINTING),
        "recompute decoder blocks in backward (selective: only the cheap ops)",
    )
    # torch.compile each decoder block
    compile: bool = key("true or false")
    # on CUDA, fp32 matmuls in TF32 on tensor cores; false: full fp32
    tf32: bool = key("true or false")
    packing: bool = key("true or false", "several examples per row, no attention across them")
    # lm_head + loss over this many tokens at a time, recomputed in backward (never the whole micro-
    # batch's fp32 logits); 0 or null: all at once
    loss_chunk_tokens: Count | None = key(
        "0 or null (the whole micro-batch's logits at once) or a positive number of tokens, "
        "e.g. train.loss_chunk_tokens=1024"
    )
    cpu_offload: bool = key(
        "true or false",
        "parameters, gradients and optimizer state in host memory (FSDP2's offload policy)",
    )

    def offload_notes(self, device_type: str) -> list[str]:
        """``cpu_offload`` on the CPU, where host and device memory are one: it moves nothing,
        and changes how the model is wrapped (FSDP at dp=1 too)."""
        if not self.cpu_offload or device_type != "cpu":
            return []
        return [
            f"{OFFLOAD_ON_THE_CPU} and each micro-batch's gradients are reduced, so the run "
            "follows the run without it (docs/precision-and-memory.md)"
        ]


class Checkpoint(Section):
    every_steps: Count = key(
        "0 (off) or a positive number of steps, e.g. 20", "steps between checkpoints; 0: none"
    )
    resume: Text | None = key(
        "auto, null or the path of a checkpoint folder",
        "auto: continue from the latest checkpoint in output_dir",
    )
    # complete checkpoints kept
    keep: PositiveInt | None = key("null (keep all) or a positive integer, e.g. 2")
    # `async` is a Python keyword: the field is asynchronous, spelt async in the config.
    # true: write each checkpoint in the background while training goes on
    asynchronous: bool = Field(alias="async", description="true or false")
    export: bool = key(
        "true or false", "write a Hugging Face folder to ${output_dir}/hf at the end"
    )
    # null: the source model's dtype (float32 for a model built from its config)
    export_dtype: Literal[EXPORT_DTYPES] | None = key(one_of(EXPORT_DTYPES, "the source's"))


class Debug(Section):
    # every N steps compare every TP replica across ranks; stop on any difference
    check_replicas_every: Count = key("0 (off) or a positive number of steps, e.g. 10")
    # the kinds are components/debug/faults.py's (KINDS), which names them when one is wrong
    # a resilience drill (docs/fault-injection.md), e.g. nan_grad@3
    fault: Text | None = key("null or a fault of components/debug/faults.py, e.g. nan_grad@3")


class Moe(Section):
    # true: also shard each expert's weights, gradients and optimizer state over ep_shard (world /
    # ep ranks, the copies of each ep group's experts), FSDP-style; no effect at ep=1 (FSDP over dp
    # shards them) or ep = world
    shard_experts: bool = key("true or false")
    # experts: also expert_load/layer_N/expert_E, each expert's token share
    expert_load: Literal[EXPERT_LOADS] = key(one_of(EXPERT_LOADS))
    # > 0: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert routing bias moved this much
    # per step against its load
    routing_bias_rate: Annotated[float, Field(ge=0, allow_inf_nan=False)] = key(
        "0 (off) or a positive number, e.g. moe.routing_bias_rate=0.001"
    )

    def dense_errors(self, model_name: str) -> list[str]:
        """One error per ``moe.*`` key switched on for a model without experts."""
        switched_on = {
            "shard_experts": self.shard_experts,
            "expert_load": self.expert_load != "layers",
            "routing_bias_rate": self.routing_bias_rate > 0,
        }
        return [
            f"moe.{name}={show(getattr(self, name))} needs an MoE model: model={model_name} has "
            f"no experts (model.experts names none); remove it"
            for name, on in switched_on.items()
            if on
        ]


class Profile(Section):
    # 1-based steps [FIRST, LAST] (as metrics.jsonl's step) traced by torch.profiler, one trace per
    # rank under ${output_dir}/profile/ (docs/profiling.md); null: no profiler
    steps: Annotated[list[PositiveInt], Field(min_length=2, max_length=2)] | None = key(
        "null (off) or [FIRST, LAST], 1-based steps of the run, e.g. profile.steps=[2,3]"
    )
    # on CUDA: a memory snapshot of the profiled steps beside the trace (PyTorch's memory viz)
    memory: bool = key("true or false")

    def errors(self, max_steps: int, device_type: str) -> list[str]:
        """The profiled range within the run (past ``train.stop_after``: the resumed one's), the
        memory snapshot on CUDA."""
        from components.training.profiler import profile_errors

        return profile_errors(self.steps, self.memory, max_steps, device_type)


class Model(Section):
    name: Text = key("a name, e.g. model.name=llama")
    family: Text | None = key("null or a model family, e.g. llama")
    pretrained_path: Text | None = key(
        "null, a local Hugging Face model folder or a Hub id (owner/name)",
        "with model=pretrained: the folder or Hub id of the model to fine-tune",
    )
    source: Literal[MODEL_SOURCES] | None = key(one_of(MODEL_SOURCES, "pretrained_path"))
    experts: list[Text] | None = key(  # null: the family's (components/models/families.py)
        "null (the family's) or a list of module patterns, e.g. [model.layers.*.mlp.experts]",
    )
    routers: list[Text] | None = key(
        "null (the family's) or a list of module patterns, e.g. [model.layers.*.mlp.gate]",
    )
    config: dict[str, Any] = key(
        "a mapping of Hugging Face config keys, e.g. model.config.hidden_size=512"
    )
    # the attention kernel; packed rows reach flash_attention_2/3 and flex_attention as sequence
    # boundaries (docs/data.md)
    attn_implementation: Literal[ATTENTION_IMPLEMENTATIONS] | None = key(
        one_of(ATTENTION_IMPLEMENTATIONS, "transformers' default: sdpa, else eager")
    )


PEFT_METHODS = ("none", "lora", "qlora")
ADAPTER_METHODS = ("lora", "qlora")  # the methods that train adapters, with the same keys


class Peft(Section):
    """Parameter-efficient fine-tuning (docs/lora.md): ``peft=none`` trains every weight, its other
    keys null; ``peft=lora`` trains low-rank adapters on a frozen base; ``peft=qlora`` the same
    adapters on a base whose adapted linears are stored in NF4."""

    name: Literal[PEFT_METHODS] = key(one_of(PEFT_METHODS))
    # LoRA's r: the adapters' inner size
    rank: PositiveInt | None = key("a positive integer with peft=lora, e.g. peft.rank=8")
    # the update is alpha / rank · B·A
    alpha: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = key(
        "a positive number with peft=lora, e.g. peft.alpha=16"
    )
    # dropout on the adapter's input
    dropout: Annotated[float, Field(ge=0, lt=1)] | None = key(
        "a number in [0, 1) with peft=lora, e.g. peft.dropout=0.05"
    )
    # fnmatch patterns of the module names of the linear layers that get adapters, each matching
    # one or more; null with peft=lora: the attention and MLP projections the model has
    target_modules: Annotated[list[Text], Field(min_length=1)] | None = key(
        "a list of module name patterns with peft=lora, e.g. peft.target_modules=['*.q_proj']"
    )
    # per-expert adapters on MoE experts
    experts: bool | None = key("true or false with peft=lora")
    # the export also writes base + adapters merged as a Hugging Face folder
    merge: bool | None = key("true or false with peft=lora")

    @property
    def adapters(self) -> bool:
        """Whether the method trains adapters (``lora``, ``qlora``): every key below is read."""
        return self.name in ADAPTER_METHODS

    def errors(self) -> list[str]:
        """Keys set that the chosen method does not read, or left null that it needs."""
        keys = [name for name in type(self).model_fields if name != "name"]
        if not self.adapters:
            return [
                f"peft.{name}={show(getattr(self, name))} is read only with peft=lora or "
                f"peft=qlora: add one or remove it"
                for name in keys
                if getattr(self, name) is not None
            ]
        found = [
            f"peft.{name} is null: peft={self.name} needs it"
            for name in keys
            if getattr(self, name) is None and name != "target_modules"  # null: the projections
        ]
        if self.experts and self.dropout:  # PEFT's ParamWrapper refuses lora_dropout != 0
            found.append(
                f"peft.dropout={show(self.dropout)} with peft.experts=true is not supported: "
                "PEFT's adapters on expert weights (target_parameters) take no dropout, so the "
                "export could not load; use peft.dropout=0.0 or peft.experts=false"
            )
        return found


class Targeted(BaseModel):
    """A group built by ``_target_``: its other keys belong to the target's signature."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True, populate_by_name=True)
    target: Text = Field(alias="_target_", description="a dotted class path")

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Optim(Targeted):
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)] = key(
        "a positive number, e.g. optim.lr=3e-3", "the peak learning rate"
    )

    def options(self) -> dict[str, Any]:
        return {"lr": self.lr, **super().options()}

    def errors(self) -> list[str]:
        """The optimizer's class and its options, then the optimizer's own checks (betas, ...)."""
        from components.training.optimizer import optimizer_errors  # torch: not for --help

        return optimizer_errors(self.target, self.options())


class Logger(Targeted):
    """The metrics tracker: its class's options besides the run's own (``output_dir``, the first
    step)."""

    def errors(self, output: Path) -> list[str]:
        """The tracker installed, its class and options, and their values for a run into
        ``output``."""
        if missing := check_logger_available(self.target):
            return [missing]
        fixed = {"output_dir", "first_step"}
        errors = check_target("logger", self.target, self.options(), object, fixed)
        return errors or check_logger_options(self.target, self.options(), output)


class Data(Targeted):
    """Keys every data source has; the rest (path, split, columns, ...) are the source class's
    fields."""

    num_examples: PositiveInt | None = key(
        "null (all) or a positive integer, e.g. data.num_examples=400"
    )
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = key("a number in [0, 1), e.g. 0.05")
    # which assistant messages of a messages record are trained: every one, or the final one
    loss_on: Literal[LOSS_ON] = key(one_of(LOSS_ON), "which assistant turns are trained")
    # a data=hf source read as a stream, tokenized and packed on the fly (components/data/streaming)
    streaming: bool = key("true or false, e.g. data.streaming=true")

    def streaming_errors(self, val_every: int) -> list[str]:
        """What a streamed ``data=hf`` source cannot do: hold out a validation split (the size of
        a stream is not known before it is read), so validate (``val_every``); a streamed mixture
        neither. Other sources are refused by the data checks."""
        if not self.streaming or not self.target.endswith((".HFSource", ".MixSource")):
            return []
        held_out = {"data.val_fraction=0": self.val_fraction > 0, "train.val_every=0": val_every}
        if not (keys := [key for key, given in held_out.items() if given]):
            return []
        why = "holds out no validation split (a stream's size is not known before it is read)"
        return [f"data.streaming=true {why}: set {' and '.join(keys)}"]


class Schedule(BaseModel):
    """The LR schedule: a name (today's warmup_cosine or a transformers.get_scheduler name) and its
    options."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    name: Text = key(
        "warmup_cosine, linear, cosine, constant_with_warmup or warmup_stable_decay (schedule=NAME)"
    )

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def errors(self, warmup_steps: int, max_steps: int) -> list[str]:
        """The schedule's name and options at this warm-up and length."""
        from components.training.schedule import check_schedule

        return check_schedule(self.name, warmup_steps, max_steps, self.options())


class Config(Section):
    RECIPE: ClassVar[str] = "recipes/finetune.py"  # the recipe whose config this is (messages)
    # the data's records are preference pairs (recipes/dpo.py's), else prompt and answer
    preference_pairs: ClassVar[bool] = False
    # a dense model may take ep > 1 for the experts of the frozen model beside it (distillation's
    # teacher), whose checks refuse ep where neither has experts
    experts_beside: ClassVar[bool] = False

    seed: Annotated[int, Field(ge=0, lt=2**63)] = key("an integer in [0, 2**63), e.g. seed=0")
    tp: PositiveInt = key("a positive integer, e.g. tp=2", "tensor-parallel size")
    cp: PositiveInt = key(
        "a positive integer, e.g. cp=2",
        "context-parallel size: each sequence split over cp ranks",
    )
    dp: PositiveInt | None = key(
        "null (world size / tp) or a positive integer, e.g. dp=2",
        "data-parallel size (FSDP2); null: world size / (cp × tp)",
    )
    # HSDP: FSDP replicates across dp_replicate groups, shards within dp_shard (dp = the product)
    dp_replicate: PositiveInt = key("a positive integer, e.g. dp_replicate=2")
    # HSDP's shard group size; null: dp / dp_replicate
    dp_shard: PositiveInt | None = key(
        "null (dp / dp_replicate) or a positive integer, e.g. dp_shard=2"
    )
    pp: PositiveInt = key(
        "a positive integer, e.g. pp=2",
        "pipeline-parallel size: the decoder layers cut into pp stages",
    )
    # how the step's micro-batches flow through the stages
    pp_schedule: Literal[PIPELINE_SCHEDULES] = key(one_of(PIPELINE_SCHEDULES))
    # model stages each pipeline rank holds (2 or more: interleaved_1f1b)
    pp_stages_per_rank: PositiveInt = key("a positive integer, e.g. pp_stages_per_rank=2")
    sp: bool = key("true or false", "sequence parallelism on the TP ranks")
    ep: PositiveInt = key("a positive integer, e.g. ep=2", "expert-parallel size for MoE models")
    nproc: PositiveInt | None = key(
        "null (dp × cp × tp) or a positive integer, e.g. nproc=4",
        "local ranks without torchrun; null: dp × cp × tp on CPU, the GPUs on CUDA",
    )
    # the recipe's own launcher: after a rank fails, restart every rank up to N times (torchrun:
    # --max-restarts); needs checkpoint.resume=auto
    max_restarts: Count = key("0 (none) or a positive number of restarts, e.g. max_restarts=1")
    # intra-op threads per rank; null: OMP_NUM_THREADS if set, else cores / local ranks
    cpu_threads: PositiveInt | None = key(
        "null (OMP_NUM_THREADS, else cores / local ranks) or a positive integer"
    )
    # a collective waiting longer fails the run (NCCL's default; raise it for huge loads)
    collective_timeout_minutes: Annotated[float, Field(gt=0, allow_inf_nan=False)] = key(
        "a positive number of minutes, e.g. collective_timeout_minutes=30"
    )
    # a rank whose heartbeat shows no progress for this long ends the run (docs/failures.md)
    hang_timeout_s: Annotated[float, Field(ge=2, allow_inf_nan=False)] | None = key(
        "null (off: the collective timeout alone) or a number of seconds of at least 2, e.g. "
        "hang_timeout_s=300"
    )
    output_dir: Text = key(
        "a folder path, e.g. output_dir=outputs/run1",
        "the run's folder (default: a new outputs/MODEL/DATE_TIME)",
    )
    # true: a fresh run replaces another run's files in output_dir
    overwrite_output_dir: bool = key("true or false")
    dry_run: bool = key(
        "true or false", "true: check, plan the layout on fake ranks, write plan.json, exit"
    )
    # with dry_run: one device's memory, to say whether the plan fits
    device_memory_gib: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = key(
        "null (the visible device's) or a positive number of GiB, e.g. device_memory_gib=80"
    )
    # with dry_run: the device type planned for (what train.cpu_offload moves); null: this one
    dry_run_device: Literal[DEVICE_TYPES] | None = key(one_of(DEVICE_TYPES, "this machine's"))
    cache_dir: Text = key(
        "a folder for tokenized data and converted models, e.g. cache_dir=~/.cache/shardtune",
        "tokenized data, trained tokenizers, converted models",
    )
    train: Train
    checkpoint: Checkpoint
    debug: Debug
    moe: Moe
    profile: Profile
    model: Model
    optim: Optim
    data: Data
    schedule: Schedule
    logger: Logger
    peft: Peft

    # the degrees (tp, cp, pp, ...) this recipe runs at 1 only, each with why (fine-tuning's: none)
    DEGREES_AT_ONE: ClassVar[dict[str, str]] = {}

    def refused_degree(self, name: str, size: int) -> str | None:
        """Why this recipe does not run degree ``name`` at ``size`` (:data:`DEGREES_AT_ONE`), as
        its checks say it of the settings and its dry run of a layout it could suggest; None:
        it runs it."""
        why = self.DEGREES_AT_ONE.get(name)
        if why is None or size == 1:
            return None
        [problem] = refused_settings(self.RECIPE, [(name, size, True, why)])
        return problem.message

    def degree_problems(self) -> list[Problem]:
        """The settings' degrees this recipe does not run, one problem each."""
        found = []
        for name in self.DEGREES_AT_ONE:
            if line := self.refused_degree(name, getattr(self, name)):
                found.append(Problem(key=name, message=line))
        return found

    def option_problems(self, warmup: int, output: Path, device_type: str) -> tuple[list, Any]:
        """(problems, the parsed ``debug.fault``): each section's own checks: the optimizer, the
        logger (for a run into ``output``), the schedule (``warmup`` steps), ``debug.fault`` and
        ``profile`` (on ``device_type``'s backend), ``peft``."""
        from components.debug.faults import fault_backend_errors, parse_fault

        max_steps = self.train.max_steps
        found = problems("optim", self.optim.errors())
        found += problems("logger", self.logger.errors(output))
        found += problems("schedule", self.schedule.errors(warmup, max_steps))
        try:
            fault = parse_fault(self.debug.fault)
        except ValueError as error:
            fault, found = None, [*found, Problem(key="debug.fault", message=str(error))]
        found += problems("debug.fault", fault_backend_errors(fault, device_type))
        found += problems("profile", self.profile.errors(max_steps, device_type))
        if not self.preference_pairs:  # pairs are never streamed: the data checks' one line
            found += problems("data.streaming", self.data.streaming_errors(self.train.val_every))
        return found + problems("peft", self.peft.errors()), fault

    def model_errors(self, model_type: str, experts: tuple[str, ...]) -> list[str]:
        """What the recipe cannot train of a model of ``model_type`` with ``experts`` (none:
        ``finetune.py`` trains them all)."""
        return []

    def model_folders(self) -> dict[str, str | None]:
        """The folders the run reads a model from, by key (a recipe adds its frozen model's)."""
        return {"model.pretrained_path": self.model.pretrained_path}

    def pipeline_errors(self) -> list[str]:
        """``pp_schedule`` and ``pp_stages_per_rank`` that disagree (interleaved: 2 stages or more
        per rank)."""
        interleaved, per_rank = self.pp_schedule == "interleaved_1f1b", self.pp_stages_per_rank
        if interleaved == (per_rank > 1):
            return []
        fix = "interleaved_1f1b with 2 stages per rank or more, or gpipe or 1f1b with 1"
        return [f"pp_schedule={self.pp_schedule} with pp_stages_per_rank={per_rank}: use {fix}"]

    def restart_errors(self) -> list[str]:
        """``max_restarts`` restarts the recipe's own launcher's ranks, which continue from the
        last complete checkpoint: it needs ``checkpoint.resume=auto``."""
        restarts, resume = self.max_restarts, self.checkpoint.resume
        if not restarts or resume == "auto":
            return []
        why = f"max_restarts={restarts} needs checkpoint.resume=auto (got {show(resume)}): "
        return [f"{why}restarted ranks continue from the last complete checkpoint in output_dir"]

    def unread_keys(self, dims: "ParallelDims") -> list[str]:
        """The keys set to something this run's layout ``dims`` never reads, each said (never
        silently ignored): they are harmless, and right in another layout (a sweep over tp, a dry
        run)."""
        unread = []
        if self.sp and dims.tp == 1:
            unread.append(
                "sp=true changes nothing at tp=1: sequence parallelism splits the norms' sequence "
                "over the TP ranks, and there is one"
            )
        if self.train.fp8_recipe != "tensorwise" and self.train.precision != "fp8":
            recipe = f"train.fp8_recipe={self.train.fp8_recipe}"
            unread.append(f"{recipe} is read with train.precision=fp8 only: this run has none")
        if self.device_memory_gib is not None and not self.dry_run:
            unread.append(
                f"device_memory_gib={self.device_memory_gib:g} is read by dry_run=true only "
                "(whether the planned layout fits): this run trains on the device it has"
            )
        if self.dry_run_device is not None and not self.dry_run:
            unread.append(
                f"dry_run_device={self.dry_run_device} is read by dry_run=true only (the device "
                "the plan is for): this run trains on the device it has"
            )
        return unread + self._unread_pipeline_keys(dims) + self._unread_expert_keys(dims)

    def _unread_pipeline_keys(self, dims: "ParallelDims") -> list[str]:
        """``pp_schedule`` and ``pp_stages_per_rank`` away from their defaults (conf/config.yaml's)
        at pp=1, which has no pipeline: one line each. A dry run reads them for a pp it
        suggests."""
        if dims.pp > 1 or self.dry_run:
            return []
        pipeline = (("pp_schedule", "1f1b"), ("pp_stages_per_rank", 1))
        return [
            f"{key}={value} is read with pp > 1 only: this run has pp=1"
            for key, default in pipeline
            if (value := getattr(self, key)) != default
        ]

    def _unread_expert_keys(self, dims: "ParallelDims") -> list[str]:
        """``moe.shard_experts`` with nothing to shard over; replica checks with nothing to
        compare."""
        unread = []
        if self.moe.shard_experts and dims.ep == 1:
            unread.append(
                "moe.shard_experts=true changes nothing at ep=1: the experts are not split by "
                "expert (with dp > 1, FSDP shards them like every other weight)"
            )
        elif self.moe.shard_experts and dims.ep_shard == 1:
            unread.append(
                f"moe.shard_experts=true changes nothing at ep={dims.ep} on {dims.world_size} "
                "ranks: each expert has one copy, with nothing to shard it over"
            )
        copies = dims.ep > 1 and dims.ep_shard > 1 and not self.moe.shard_experts
        every = self.debug.check_replicas_every
        if every and dims.tp == 1 and not copies:
            unread.append(
                f"debug.check_replicas_every={every} compares nothing here: at tp=1 there are no "
                "TP replicas (nor experts copied over ep_shard)"
            )
        return unread


def refused_settings(recipe: str, refused: list[tuple[str, Any, bool, str]]) -> list[Problem]:
    """One problem per setting a ``recipe`` (``recipes/dpo.py``) refuses, of ``refused``'s (key,
    its value, refused, why), naming the key."""
    script = recipe.removeprefix("recipes/")
    return [
        Problem(key=name, message=f"{name}={show(value)} is not run by {script}: {why}")
        for name, value, on, why in refused
        if on
    ]
