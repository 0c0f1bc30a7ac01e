"""The parallel layout, one owner: the degrees a run asks for (:class:`Degrees`), how a world of
ranks is split by them (:class:`ParallelDims`), every rule a layout must keep (each problem one
line; those that read the model or the optimizer read them as data, :class:`ModelFacts` and
:class:`OptimizerFacts`), the default number of ranks, the pad multiple of a micro-batch, the
candidate layouts of the dry run, and the meshes, named by purpose (:class:`Meshes`). The recipe's
checks, the dry run and the ranks all ask here; no rule is written anywhere else.

The mesh: ``("dp", "tp")`` with tp innermost (``("dp", "cp", "tp")`` with context parallelism;
``("dp_replicate", "dp_shard", "tp")`` with HSDP; ``pp`` outermost with pipeline parallelism).
Tensor parallelism talks the most, so its ranks are adjacent (innermost: on one node, on NVLink),
then the cp ranks that split one sequence. Expert parallelism uses the same ranks: the experts'
mesh reshapes all ranks into ``(world // ep, ep)``, so a rank's expert group is ``ep`` adjacent
ranks (inside one TP group when ``ep`` divides ``tp``, else spanning several dp ranks) and
``ep_shard`` runs across the groups that hold the same experts.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from components.problems import Problem


class LayoutError(ValueError):
    """Degrees that do not split the world: one line per problem, all at once."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("; ".join(lines))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a layout splits and composes with: the step's batch geometry and the settings the
    layout rules read."""

    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    compile: bool = False
    fp8: bool = False  # train.precision=fp8: float8 matmuls, whose tokens per rank the rules read
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    cpu_offload: bool = False  # train.cpu_offload: FSDP2's offload policy, so FSDP at any dp


# The model's sizes tp must divide, by their config keys
TP_SIZE_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def tp_sizes(config: Any) -> dict[str, Any]:
    """The sizes of a Hugging Face ``config`` that tp must divide, by key (a list per layer
    where the config has one, Gemma 3n's intermediate sizes); the keys it lacks are left out."""
    return {key: value for key in TP_SIZE_KEYS if (value := getattr(config, key, None)) is not None}


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the layout rules read of the model: its name (``model=...``), whether it has experts,
    its decoder layers (None: its config names no one stack of them, BLT's), the sizes tp must
    divide (:func:`tp_sizes`), its expert modules called with tokens already routed (Llama 4's),
    as the problem names them (None: none, or the model was not built to look), and at the other
    degrees a dry run may suggest, keyed (tp, cp, pp or dp_replicate, size), what the model's
    checks refuse there (its TP plan, fp8's shapes, NF4 tiles; its attention with cp; a pipeline
    stage's structure: ``components/models/checks.py``'s ``other_layout_refusals``; and what the
    recipe itself does not run: DPO's cp and pp)."""

    name: str
    moe: bool
    layers: int | None
    tp_sizes: Mapping[str, Any] = field(default_factory=dict)
    routed_experts: str | None = None
    refusals: Mapping[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OptimizerFacts:
    """What the layout rules read of the optimizer: its class (``optim._target_``) and the
    ``foreach`` option as given (None: left to torch)."""

    target: str
    foreach: bool | None = None


def tp_size_errors(sizes: Mapping[str, Any], tp: int) -> list[str]:
    """The model's ``sizes`` (:func:`tp_sizes`) that ``tp`` does not divide, one line each."""
    return [
        f"tp ({tp}) must divide {key} ({value})"
        for key, value in sizes.items()
        if any(size % tp for size in _each(value))
    ]


def tp_size_problems(sizes: Mapping[str, Any], tp: int) -> list[Problem]:
    """:func:`tp_size_errors` keyed ``tp``, and with any, one more naming the tp values that fit
    (those dividing every size)."""
    errors = tp_size_errors(sizes, tp) if tp > 1 else []
    if not errors:
        return []
    every = [size for value in sizes.values() for size in _each(value)]
    fits = [n for n in range(1, min(every) + 1) if all(size % n == 0 for size in every)]
    hint = f"tp values that fit this model: {', '.join(map(str, fits))}"
    return [Problem(key="tp", message=error) for error in [*errors, hint]]


def _each(value: Any) -> list[int]:
    """A size, or a per-layer list of them, as a list (a layer's None left out)."""
    values = value if isinstance(value, list | tuple) else [value]
    return [size for size in values if size is not None]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world_size = pp × dp_replicate × dp_shard × cp × tp`` ranks are split; ``ep`` divides
    the world; ``sp``: the norms' sequence split over the TP ranks."""

    pp: int = 1  # pipeline stages' ranks, outermost
    dp_replicate: int = 1  # HSDP's replica groups; FSDP shards within dp_shard
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False

    @property
    def dp(self) -> int:
        """The ranks that read different rows of the batch: ``dp_replicate × dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks the weights are data parallel over (FSDP's, the loss's): ``dp × cp``."""
        return self.dp * self.cp

    @property
    def gathers_weights(self) -> bool:
        """Whether FSDP gathers each weight from other ranks (data parallel over more than one;
        not FSDP's one-rank shard of an offloaded run): where fp8's tensorwise recipe all-gathers
        the float8 weights."""
        return self.data_parallel > 1

    def fsdp_wraps(self, cpu_offload: bool) -> bool:
        """Whether FSDP wraps the model: data parallel over more than one rank, or offloading to
        the host (``train.cpu_offload``: FSDP2's policy, on a one-rank shard at dp=1)."""
        return self.gathers_weights or cpu_offload

    @property
    def fsdp_shards(self) -> int:
        """The ranks FSDP splits a weight over (``Meshes.fsdp``'s shard dimension): ``dp × cp``;
        with HSDP ``dp_shard``, each replica group holding a copy."""
        return self.dp_shard if self.dp_replicate > 1 else self.data_parallel

    @property
    def ep_shard(self) -> int:
        """The groups of ``ep`` ranks that hold the same experts."""
        return self.world_size // self.ep

    def problems(self, work: Workload) -> list[Problem]:
        """Why ``work`` cannot run on this layout, whatever the model: the global batch splits
        into micro-batches over dp, a row into tp slices with sp and into 2·cp chunks with cp,
        and with fp8 into multiples of 16 tokens per cp rank."""
        found = []
        if work.global_batch_size % (work.micro_batch_size * self.dp):
            fits = work.micro_batch_size * self.dp
            example = max(fits, work.global_batch_size // fits * fits)
            message = (
                f"train.global_batch_size ({work.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({work.micro_batch_size}) × dp ({self.dp}): use a "
                f"multiple of {fits}, e.g. train.global_batch_size={example}"
            )
            found.append(Problem(key="train.global_batch_size", message=message))
        if self.sp and work.seq_len % self.tp:
            fits = max(self.tp, work.seq_len // self.tp * self.tp)
            message = (
                f"train.seq_len ({work.seq_len}) must be divisible by tp ({self.tp}) with sp=true "
                f"(each rank holds an equal slice of the sequence): use e.g. train.seq_len={fits}"
            )
            found.append(Problem(key="train.seq_len", message=message))
        found += self.fp8_problems(work.seq_len) if work.fp8 else []
        found += self._offload_problems(work)
        return found + self._context_parallel_problems(work)

    def _offload_problems(self, work: Workload) -> list[Problem]:
        """``train.cpu_offload`` with ep > 1 (the experts split over ep are outside FSDP, whose
        offload policy moves the rest, and would stay in device memory) or pp > 1 (a pipeline
        stage is placed on its parameters' device, which offload makes the host's)."""
        if not work.cpu_offload:
            return []
        found = []
        if self.ep > 1:
            message = (
                f"train.cpu_offload=true is not supported with ep={self.ep}: the experts split "
                "over ep are outside FSDP, whose offload policy moves the rest to host memory, so "
                "they would stay in device memory; use ep=1 (the experts are then sharded and "
                "offloaded with the rest)"
            )
            found.append(Problem(key="train.cpu_offload", message=message))
        if self.pp > 1:
            message = (
                f"train.cpu_offload=true is not supported with pp={self.pp} yet: a pipeline "
                "stage runs on its parameters' device, which offload makes the host's, so on a "
                "GPU its activations would be sent from the host; use pp=1"
            )
            found.append(Problem(key="train.cpu_offload", message=message))
        return found

    def _context_parallel_problems(self, work: Workload) -> list[Problem]:
        """With cp > 1: ``seq_len`` splits into ``2·cp`` equal chunks (with sp a rank's share into
        tp slices); ``train.compile`` is not supported with cp yet."""
        if self.cp == 1:
            return []
        found, seq_len, multiple = [], work.seq_len, self.sequence_multiple()
        if seq_len % multiple:
            why = f"2 × cp ({2 * self.cp})" if multiple == 2 * self.cp else f"{multiple}"
            use = f"train.seq_len={max(multiple, seq_len // multiple * multiple)}"
            split = ", split over tp with sp=true" if self.sp else ""
            message = (
                f"train.seq_len ({seq_len}) must be divisible by {why} with cp={self.cp} (each cp "
                f"rank holds two of 2 × cp equal chunks{split}): use e.g. {use}"
            )
            found.append(Problem(key="train.seq_len", message=message))
        if work.compile:
            message = f"train.compile=true with cp={self.cp} is not supported yet: use cp=1"
            found.append(Problem(key="train.compile", message=message))
        return found

    def sequence_multiple(self) -> int:
        """What a row's length must be a multiple of with cp > 1: ``2·cp`` chunks (zig-zag, each
        rank two), with sp each rank's share in tp slices."""
        return math.lcm(2 * self.cp, self.cp * self.tp if self.sp else 1)

    def model_problems(self, work: Workload, model: ModelFacts) -> list[Problem]:
        """Why this layout cannot run ``model``: experts with cp, or split over ep where they take
        tokens already routed; with pp what the pipeline does not compose with yet, and the
        stages it needs."""
        found = self._expert_problems(model)
        if model.moe and self.cp > 1:
            message = (
                f"cp={self.cp} with an MoE model (model={model.name}) is not supported yet: "
                "use cp=1"
            )
            found.append(Problem(key="cp", message=message))
        if self.pp == 1:
            return found
        pp = f"pp={self.pp}"
        found += [
            Problem(
                key=key, message=f"{pp} with {what} is not supported yet: use pp=1, or {instead}"
            )
            for key, (on, what, instead) in self._pipeline_refusals(work, model).items()
            if on
        ]
        micro_batches = work.global_batch_size // (work.micro_batch_size * self.dp)
        return found + self._stage_problems(work, model.layers, micro_batches)

    def _expert_problems(self, model: ModelFacts) -> list[Problem]:
        """Experts called with tokens already routed split over ep only where ep divides tp (the
        TP group's tokens are the same: folded) or at tp=1 (each rank's own tokens)."""
        routed = model.routed_experts
        if routed is None or self.ep == 1 or self.tp == 1 or self.tp % self.ep == 0:
            return []
        message = (
            f"{routed} takes its tokens already routed: split only where ep divides tp or at "
            f"tp=1, not at ep={self.ep} tp={self.tp}"
        )
        return [Problem(key="ep", message=message)]

    def optimizer_problems(self, optimizer: OptimizerFacts, work: Workload) -> list[Problem]:
        """What ``optimizer`` cannot run at this layout: ``foreach=true`` at tp > 1 without FSDP,
        where the parameters mix DTensors and plain replicas (``training/optimizer.py``'s
        ``foreach_choice``). (torchao's ``AdamW8bit`` over parameters sharded by TP and FSDP at
        once failed in its compiled step only through AOT autograd's cache, which
        ``build_optimizer`` turns off: it runs.)"""
        if not optimizer.foreach or self.tp == 1 or self.fsdp_wraps(work.cpu_offload):
            return []
        message = (
            f"optim.foreach=true at tp={self.tp} without data parallelism: the trainable "
            "parameters mix TP's DTensor shards with the plain replicas it leaves whole, which "
            "torch's foreach kernels do not take in one list; leave optim.foreach unset (the "
            "per-tensor update, the same numbers) or add dp so that FSDP makes every parameter a "
            "DTensor"
        )
        return [Problem(key="optim", message=message)]

    def _pipeline_refusals(self, work: Workload, model: ModelFacts) -> dict[str, tuple]:
        """key: (refused with pp, what, what would work with pp)."""
        interleaved = work.pp_stages_per_rank > 1
        return {
            "cp": (self.cp > 1, f"cp={self.cp}", "cp=1"),
            "ep": (self.ep > 1, f"ep={self.ep}", "ep=1"),
            "model": (model.moe, "an MoE model", "a dense model"),
            "train.compile": (work.compile, "train.compile=true", "train.compile=false"),
            "dp": (interleaved and self.dp > 1, f"interleaved stages and dp={self.dp}", "dp=1"),
        }

    def _stage_problems(self, work: Workload, layers: int | None, micro_batches: int) -> list:
        """A layer or more per stage (the embedding and the head weighed as one), ``pp``
        micro-batches or more for the 1F1B schedules, whole rounds of ``pp`` interleaved."""
        found, schedule = [], work.pp_schedule
        stages = self.pp * work.pp_stages_per_rank
        if layers is not None and layers + 2 < stages:
            needs = f"{stages} pipeline stages need {stages - 2} decoder layers or more"
            found.append(Problem(key="pp", message=f"{needs}: the model has {layers}"))
        interleaved = schedule == "interleaved_1f1b"
        if (schedule != "gpipe" and micro_batches < self.pp) or (
            interleaved and micro_batches % self.pp
        ):
            needs = f"a multiple of pp={self.pp}" if interleaved else f"pp={self.pp} or more"
            message = (
                f"pp_schedule={schedule} needs {needs} micro-batches per step, this step has "
                f"{micro_batches}"
            )
            found.append(Problem(key="train.global_batch_size", message=message))
        return found

    def fp8_problems(self, seq_len: int) -> list[Problem]:
        """fp8's matmuls (``torch._scaled_mm``) take a multiple of 16 tokens per cp rank."""
        tokens = 16 * self.cp
        if seq_len % tokens == 0:
            return []
        fits = max(tokens, seq_len // tokens * tokens)
        why = f"train.seq_len ({seq_len}) must be a multiple of {tokens}"
        message = f"{why} with train.precision=fp8 (torch._scaled_mm): use train.seq_len={fits}"
        return [Problem(key="train.seq_len", message=message)]

    def pad_multiple(self, fp8: bool = False) -> int | None:
        """What a micro-batch's length is rounded up to: 8, and with sp an equal slice per TP
        rank, and with cp 2 × cp equal chunks (with sp too, a cp rank's share in tp slices); with
        ``fp8`` each rank's tokens a multiple of 16 (``torch._scaled_mm``'s inner dimension in the
        weight gradient); with pp None, every micro-batch ``train.seq_len`` long (the stages pass
        activations of one fixed shape)."""
        if self.pp > 1:
            return None
        tp = self.tp if self.sp else 1
        tokens = 16 * self.cp if fp8 else 1
        chunks = self.sequence_multiple() if self.cp > 1 else 1
        return math.lcm(8 * tp, chunks, tokens)

    def all_problems(
        self, work: Workload, model: ModelFacts, optimizer: OptimizerFacts
    ) -> list[Problem]:
        """Every rule of this layout for a run (the dry run's filter): :meth:`problems`,
        :meth:`optimizer_problems`, :func:`tp_size_problems`, what the model's checks refuse at
        this tp, cp and pp (``ModelFacts.refusals``) and :meth:`model_problems`, the same the
        recipe's checks ask one by one."""
        found = self.problems(work) + self.optimizer_problems(optimizer, work)
        found += tp_size_problems(model.tp_sizes, self.tp)
        for name in ("tp", "cp", "pp", "dp_replicate"):
            refused = model.refusals.get((name, getattr(self, name)), ())
            found += [Problem(key=name, message=line) for line in refused]
        return found + self.model_problems(work, model)

    def changes(self) -> list[list[tuple[str, dict[str, int]]]]:
        """The changes of degree on the same world the dry run may suggest, by kind, each with the
        override that makes it: a larger tp, cp or pp (dp shrinks), fewer HSDP replicas. Whether
        one fits is :meth:`changed`'s and :meth:`all_problems`'."""
        groups = []
        for name in ("tp", "cp", "pp"):
            groups.append([(f"{name}={size}", {name: size}) for size in self.larger(name)])
        replicas = [r for r in range(self.dp_replicate - 1, 0, -1) if self.dp % r == 0]
        groups.append([(f"dp_replicate={r}", {"dp_replicate": r}) for r in replicas])
        return groups

    def larger(self, name: str) -> list[int]:
        """The sizes of degree ``name`` (tp, cp, pp) above this one that divide the world."""
        world = self.world_size
        return [size for size in range(getattr(self, name) + 1, world + 1) if world % size == 0]

    def changed(self, **degrees: int) -> "ParallelDims":
        """This layout with ``degrees`` changed on the same world, dp_shard taking up the rest.

        Raises:
            LayoutError: as :meth:`Degrees.resolve`.
        """
        sizes = dict(pp=self.pp, dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp)
        sizes |= dict(ep=self.ep, sp=self.sp) | degrees
        return Degrees(**sizes).resolve(self.world_size)

    def mesh_layout(self) -> tuple[tuple[str, int], ...]:
        """The mesh's dimensions as data, outermost first: ``pp`` (when > 1), then ``dp`` (with
        HSDP ``dp_replicate``, ``dp_shard``), ``cp`` (when > 1), ``tp`` innermost."""
        pipeline = (("pp", self.pp),) if self.pp > 1 else ()
        if self.dp_replicate > 1:
            data = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
        else:
            data = (("dp", self.dp),)
        context = (("cp", self.cp),) if self.cp > 1 else ()
        return (*pipeline, *data, *context, ("tp", self.tp))

    def build_meshes(self, device_type: str, timeout: timedelta | None = None) -> "Meshes":
        """Every mesh of the run, made here at the same moment on every rank, as their process
        groups must be; their groups time out after ``timeout`` (the run's
        ``collective_timeout_minutes``)."""
        layout = self.mesh_layout()
        shape, names = tuple(size for _, size in layout), tuple(name for name, _ in layout)
        world = _with_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names), timeout)
        hsdp = world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else None
        batch = world["dp"] if hsdp is None else _with_timeout(hsdp._flatten("dp"), timeout)
        loss = _with_timeout(world["dp", "cp"]._flatten("dp_cp"), timeout) if self.cp > 1 else batch
        fsdp = loss if hsdp is None else hsdp
        experts = self._experts_mesh(world, timeout) if self.ep > 1 else None
        return Meshes(world=world, batch=batch, loss=loss, fsdp=fsdp, experts=experts)

    def _experts_mesh(self, world: DeviceMesh, timeout: timedelta | None) -> DeviceMesh:
        """The ``("ep_shard", "ep")`` view of the same ranks, from the world mesh's root: ``ep``
        adjacent ranks split the experts; its process groups exist only when ep > 1."""
        flat = world._flatten("world")
        return _with_timeout(
            flat._unflatten(0, (self.ep_shard, self.ep), ("ep_shard", "ep")), timeout
        )


@dataclass(frozen=True, kw_only=True)
class Meshes:
    """The run's meshes by purpose, all over the same ranks."""

    world: DeviceMesh  # every dimension (pp, dp or dp_replicate × dp_shard, cp, tp): mesh["tp"]
    batch: DeviceMesh  # the ranks that read different rows (dp): the loader's
    loss: DeviceMesh  # the ranks whose sums make one loss (dp × cp): the loss, validation
    fsdp: DeviceMesh  # what FSDP shards over: dp × cp, with HSDP (dp_replicate, dp_shard) in 2-D
    experts: DeviceMesh | None  # ("ep_shard", "ep") when ep > 1: experts split by expert


def _with_timeout(mesh: DeviceMesh, timeout: timedelta | None) -> DeviceMesh:
    """Give every group of ``mesh`` the run's timeout: torch makes a mesh's groups with the
    backend's default (30 minutes on gloo), not the timeout the world was joined with, so a stuck
    peer would hang a TP or dp collective for half an hour whatever the user set."""
    if timeout is not None:
        for dim in range(mesh.ndim):
            _set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """The degrees a run asks for (the config's ``pp``, ``dp``, ``dp_replicate``, ``dp_shard``,
    ``cp``, ``tp``, ``ep``, ``sp``); ``dp`` and ``dp_shard`` None are inferred from the world."""

    pp: int = 1
    dp: int | None = None
    dp_replicate: int = 1
    dp_shard: int | None = None
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False

    @property
    def given_dp(self) -> int | None:
        """The dp the degrees fix: ``dp``, or ``dp_replicate × dp_shard`` when ``dp_shard`` is
        set; None: inferred from the world."""
        if self.dp is not None or self.dp_shard is None:
            return self.dp
        return self.dp_replicate * self.dp_shard

    @property
    def inner(self) -> int:
        """The ranks of one data-parallel rank: ``pp × cp × tp``."""
        return self.pp * self.cp * self.tp

    @property
    def fix_the_world(self) -> bool:
        """Whether the degrees alone say how many ranks: dp given, or HSDP's replicas."""
        return self.given_dp is not None or self.dp_replicate > 1

    def least_world(self) -> int:
        """The fewest ranks these degrees fit: ``pp × cp × tp`` and ``ep`` divide it."""
        return math.lcm(self.inner, self.ep)

    def default_world(self, work: Workload, gpus: int | None = None) -> tuple[int, str | None]:
        """(the default number of ranks, a note when it leaves GPUs idle). On the CPU (``gpus``
        None) ``dp × pp × cp × tp``; on CUDA the same when dp is set, else the most of the
        ``gpus`` the layout and the batch fit (``pp × cp × tp`` and ``ep`` divide it, the global
        batch splits into dp micro-batches)."""
        if self.given_dp is not None:
            return self.given_dp * self.inner, None
        if gpus is None:
            return self.dp_replicate * self.inner, None
        for world in range(gpus, 0, -1):
            dp, fits = world // self.inner, world % self.inner == 0 and world % self.ep == 0
            if fits and work.global_batch_size % (work.micro_batch_size * dp) == 0:
                return world, None if world == gpus else self._idle_note(world, gpus, dp, work)
        return max(gpus, self.inner), None  # too few GPUs for the layout: the checks say why

    @staticmethod
    def _idle_note(world: int, gpus: int, dp: int, work: Workload) -> str:
        return (
            f"note: nproc={world} of the {gpus} visible GPUs: train.global_batch_size="
            f"{work.global_batch_size} with train.micro_batch_size={work.micro_batch_size} "
            f"splits over dp={dp} at most; for all {gpus}, set nproc and a global_batch_size "
            "that splits"
        )

    def resolve(self, world_size: int) -> ParallelDims:
        """The layout of ``world_size`` ranks, dp inferred where not given.

        Raises:
            LayoutError: one line for each degree that does not fit, e.g. "world size 6 is not
                divisible by tp=4".
        """
        errors = []
        sizes = (("world size", world_size), ("tp", self.tp), ("dp", self.dp), ("ep", self.ep))
        sizes += (("cp", self.cp), ("dp_replicate", self.dp_replicate))
        sizes += (("dp_shard", self.dp_shard), ("pp", self.pp))
        for name, value in sizes:
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                errors.append(f"{name} must be a positive integer, got {value!r}")
        if errors:
            raise LayoutError(errors)
        dp, errors = self._hybrid_dp()
        named = f"tp={self.tp}" if self.cp == 1 else f"cp={self.cp} × tp={self.tp}"
        named = f"pp={self.pp} × {named}" if self.pp > 1 else named
        if world_size % self.inner:
            errors.append(f"world size {world_size} is not divisible by {named}")
        elif dp is None:
            dp = world_size // self.inner
        elif dp * self.inner != world_size:
            product = f"dp={dp} × {named} = {dp * self.inner}"
            errors.append(f"{product} does not match the world size {world_size}")
        if dp is not None and dp % self.dp_replicate:
            errors.append(f"dp={dp} is not divisible by dp_replicate={self.dp_replicate}")
        if world_size % self.ep:
            errors.append(f"world size {world_size} is not divisible by ep={self.ep}")
        if errors:
            raise LayoutError(errors)
        sizes = dict(pp=self.pp, dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp)
        return ParallelDims(**sizes, dp_shard=dp // self.dp_replicate, ep=self.ep, sp=self.sp)

    def _hybrid_dp(self) -> tuple[int | None, list[str]]:
        """``dp`` from the HSDP pair: ``dp_replicate × dp_shard`` when ``dp_shard`` is given (and
        ``dp`` agrees with it), else ``dp`` as given (None: inferred from the world, then
        split)."""
        errors, dp, replicas = [], self.dp, self.dp_replicate
        if replicas > 1 and self.cp > 1:
            errors.append(
                f"dp_replicate={replicas} with cp={self.cp} is not supported: HSDP needs cp=1"
            )
        if self.dp_shard is not None:
            product = replicas * self.dp_shard
            if dp is not None and dp != product:
                errors.append(
                    f"dp={dp} does not match dp_replicate={replicas} × dp_shard={self.dp_shard} "
                    f"= {product}: give dp or the pair, not both"
                )
            dp = product if dp is None else dp
        return dp, errors


def resolve_parallel_dims(world_size: int, **degrees) -> ParallelDims:
    """The layout of ``world_size`` ranks for ``degrees`` (:class:`Degrees`' fields)."""
    return Degrees(**degrees).resolve(world_size)
