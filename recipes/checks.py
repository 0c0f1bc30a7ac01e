"""Every check that needs no effect, once per launch, before any rank starts: config in, problems
out (``components/runtime/problems.py``), all at once; nothing written, tokenized or trained. The
effects follow in ``recipes/prepare.py``, once.

In order: Hydra composition (:func:`compose`); interpolations, every key's type, range and the set
of known keys (``recipes/schema.py``); the optimizer's class and options; sizes that do not factor
the world; batch sizes and (with ``sp``) the sequence length that do not divide;
``checkpoint.resume``; ``output_dir``; the model (folder or config, plan divisibility, experts,
``seq_len`` within its positions); the data source.
"""

from __future__ import annotations  # the annotations name classes imported only when needed

import difflib
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.distributed.layout import (
    Degrees,
    LayoutError,
    LayoutProblem,
    ParallelDims,
)
from components.models.configs import (
    build_config,
    config_errors,
    routing_errors,
    vocab_size_errors,
)
from components.models.families import moe_patterns
from components.models.hub import resolve_model_folder
from components.runtime.cli import compose_config
from components.runtime.launch import cpu_threads_per_rank, started_by_launcher, visible_gpus
from components.runtime.output_dir import unused_folder
from components.runtime.problems import ConfigError, Problem, problems, say, show
from components.targets import check_target
from components.training.loggers import check_logger_available, check_logger_options
from components.training.optimizer import check_optimizer
from recipes.plan import Checked, model_facts, workload
from recipes.schema import Config, SchemaError, validate

if TYPE_CHECKING:
    from components.data.sources import DataSource
    from components.debug.faults import Fault

# Model, data and tokenizer modules (transformers, datasets, DTensor) are imported by the checks
# that use them: a mistyped key or a bad value is refused in about the time of `import torch`.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str]) -> DictConfig:
    """The recipe's config composed from ``overrides`` (``conf/``), or one ``error:`` line."""
    return compose_config(CONF_DIR, overrides, advise=_append_advice)


def _append_advice(key: str, overrides: list[str], message: str) -> str | None:
    """For Hydra's "Could not override 'train.max_stpes'. To append to your config use
    +train.max_stpes=5": None (Hydra's advice stands) when that ``+`` override then passes the
    checks; else what it would be refused with, and the known key of the closest name."""
    given = [override.partition("=")[0] == key for override in overrides]
    appended = [f"+{o}" if is_key else o for o, is_key in zip(overrides, given, strict=True)]
    rest = [o for o, is_key in zip(overrides, given, strict=True) if not is_key]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            settings, refused = _validated(hydra_compose(config_name="config", overrides=appended))
            known = _dotted_keys(OmegaConf.to_container(hydra_compose("config", overrides=rest)))
    except (HydraException, OmegaConfBaseException):
        return None  # Hydra would refuse the + too: its own words
    refused = refused or _open_group_problems(settings)
    if not (why := [problem.message for problem in refused if key in problem.message]):
        return None
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    meant = f"; did you mean {close[0]}?" if close else ""
    return f"Could not override '{key}', and +{key} is refused too: {why[0].splitlines()[0]}{meant}"


def _open_group_problems(settings: Config) -> list[Problem]:
    """The keys of the groups the schema leaves open (an optimizer's or logger's options, a model
    family's config), as their own checks judge them."""
    optim, logger, model = settings.optim, settings.logger, settings.model
    fixed = {"output_dir", "first_step"}
    found = problems(
        "optim",
        check_target("optim", optim.target, optim.options(), torch.optim.Optimizer, {"params"}),
    )
    found += problems(
        "logger", check_target("logger", logger.target, logger.options(), object, fixed)
    )
    if model.pretrained_path is None and model.source is None:
        found += problems("model.config", config_errors(model.family, model.config))
    return found


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    """Every key of a config as a dotted path, groups and leaves."""
    keys = []
    for name, value in tree.items():
        keys.append(f"{prefix}{name}")
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def check_sizes(
    settings: Config, device_type: str, gpus: int = 0
) -> tuple[ParallelDims | None, list[Problem]]:
    """The layout's problems (``components/distributed/layout.py``) at the world size: torchrun's,
    ``nproc``, or the layout's default; on CUDA one visible GPU (of ``gpus``) for each local
    rank."""
    cuda = device_type == "cuda" and not settings.dry_run  # a dry run plans any layout
    asked, work = degrees(settings), workload(settings)
    if started_by_launcher():
        world_size = int(os.environ["WORLD_SIZE"])
    elif settings.nproc is not None:
        world_size = settings.nproc
    else:
        world_size, note = asked.default_world(work, gpus if cuda else None)
        if note:
            say(note)
    if cuda and (found := gpu_count_problems(world_size, gpus)):
        return None, found
    try:
        dims = asked.resolve(world_size)
    except LayoutError as error:
        found = problems("nproc", error.lines)
        given = settings.nproc is not None or asked.fix_the_world
        if not (started_by_launcher() or given or device_type == "cuda"):
            fits = asked.least_world()
            how = f"start {fits} processes here with nproc={fits}, or use torchrun"
            found.append(Problem(key="nproc", message=how))
        return None, found
    return dims, layout_problems(dims.problems(work))


def degrees(settings: Config) -> Degrees:
    """The degrees the settings ask for."""
    sizes = dict(pp=settings.pp, dp=settings.dp, dp_replicate=settings.dp_replicate)
    sizes |= dict(dp_shard=settings.dp_shard, cp=settings.cp, tp=settings.tp, ep=settings.ep)
    return Degrees(**sizes, sp=settings.sp)


def layout_problems(found: list[LayoutProblem]) -> list[Problem]:
    """The layout's problems as the checks' problems."""
    return [Problem(key=problem.key, message=problem.message) for problem in found]


def gpu_count_problems(world_size: int, gpus: int) -> list[Problem]:
    """On CUDA every local rank has a GPU of its own (``LOCAL_RANK`` picks it)."""
    local = int(os.environ["LOCAL_WORLD_SIZE"]) if started_by_launcher() else world_size
    if local <= gpus:
        return []
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
    key = "nproc" if not started_by_launcher() else "LOCAL_WORLD_SIZE"
    message = (
        f"{local} ranks on this machine need a GPU each but {gpus} "
        f"{'is' if gpus == 1 else 'are'} visible{where}: use nproc={gpus} or fewer (with dp, cp "
        "and tp to match), or torchrun across machines"
    )
    return [Problem(key=key, message=message)]


def resolve_model(
    settings: Config, dims: ParallelDims | None, device_type: str
) -> tuple[Path | None, Any, list[Problem]]:
    """(weights folder or None, the model's HF config, problems): the folder or the config, then the
    TP plan and expert parallelism at these sizes, all checked on one weightless (meta-device)
    build."""
    from components.models import load_config, meta_causal_lm
    from components.models.compile import check_compile
    from components.models.folder_check import check_model_folder, check_tokenizer_folder

    model = settings.model
    try:
        if model.pretrained_path is not None or model.source is not None:
            if (
                model.config
            ):  # the group's sizes (or a user's overrides) do not apply to a pretrained folder
                say(
                    f"note: model.config of model={model.name} is not used: the folder's "
                    "config.json decides"
                )
            path = _model_folder(model.pretrained_path)
            config = load_config(path)
        else:
            if errors := config_errors(model.family, model.config) + vocab_size_errors(
                model.config
            ):
                return None, None, problems("model.config", errors)
            path, config = None, build_config(model.family, model.config)
    except (ValueError, OSError, RuntimeError) as error:
        return None, None, [Problem(key="model", message=str(error))]
    found = config_problems(settings, config, path)
    splits = dims is not None and (dims.tp > 1 or dims.ep > 1)
    lora = settings.peft.name == "lora" and not settings.peft.errors()
    fp8 = settings.train.precision == "fp8"
    try:
        meta = meta_causal_lm(config) if path is not None or splits or lora or fp8 else None
    except ValueError as error:  # a config class AutoModelForCausalLM does not map (Emu3's)
        said = str(error).split("Model type should be one of")[0].strip()  # not the long list
        return path, config, [*found, Problem(key="model", message=f"transformers: {said}")]
    except (AttributeError, TypeError, KeyError, IndexError, ImportError) as error:
        return path, config, [*found, _unbuildable(config, error)]
    if path is not None:
        meta = _causal(config, meta, path)
        rows = meta.get_input_embeddings().num_embeddings
        folder_errors = check_model_folder(path, meta) + check_tokenizer_folder(path, rows)
        found += problems("model", folder_errors)
    if lora:  # the adapters' targets, on the converted model the TP plan then sees
        experts, _ = moe_patterns(config, model.experts, model.routers)
        found += lora_problems(meta, settings.peft, experts, model.name)
    if dims is not None:
        styles, plan_found = checked_plan(settings, dims, config, meta)  # the plan checked once
        found += plan_problems(settings, dims, config, meta, plan_found)
        found += pipeline_problems(settings, dims, config, meta)
        found += fp8_problems(settings, dims, config, meta, device_type, styles) if fp8 else []
        try:
            experts, _ = moe_patterns(config, model.experts, model.routers)
            check_compile(settings.train.compile, device_type, bool(experts), dims.tp, settings.sp)
        except ValueError as error:
            found.append(Problem(key="train.compile", message=str(error)))
    return path, config, found


def _causal(config, meta, path: Path):
    """The folder's model as a causal LM: the config flags without which its class attends to
    later tokens turned on (a note), and the meta model built again if any was."""
    from components.models import meta_causal_lm
    from components.models.load import causal_flags

    if not (flags := causal_flags(config, meta)):
        return meta
    said = ", ".join(f"{flag}=true" for flag in flags)
    say(
        f"note: model type '{config.model_type}' attends to later tokens unless its config sets "
        f"{said} ({path / 'config.json'} does not): trained with {said}, as a causal LM must be; "
        "the export's config.json says so"
    )
    return meta_causal_lm(config)


def config_problems(settings: Config, config, path: Path | None) -> list[Problem]:
    """What the model's config cannot run: ``train.seq_len`` beyond its positions, more experts per
    token than it has, language adapters with no language to pick (X-MOD). ``path``: the folder
    whose ``config.json`` it is (None: ``model.config``)."""
    found = []
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)  # composite's
    if positions is not None and settings.train.seq_len > positions:
        found.append(
            Problem(
                key="train.seq_len",
                message=f"train.seq_len ({settings.train.seq_len}) exceeds the model's "
                "max_position_embeddings "
                f"(model.config.max_position_embeddings={positions}): use "
                f"train.seq_len={positions} or less"
                + ("" if path else ", or raise model.config.max_position_embeddings"),
            )
        )
    if path is None:
        return found + problems("model.config", routing_errors(config))
    where = path / "config.json"
    languages = list(getattr(config, "languages", None) or [])
    default = getattr(config, "default_language", None)
    if languages and hasattr(config, "default_language") and default not in languages:  # X-MOD
        message = (
            f"model type '{config.model_type}' picks its language adapters by language ids, "
            "which the recipe does not pass (not supported), else by its config's "
            f"default_language: {where} sets {default!r}, not one of its "
            f"languages: set default_language to one of {', '.join(languages)}"
        )
        found.append(Problem(key="model", message=message))
    return found + problems("model", [f"{where}: {e}" for e in routing_errors(config, "")])


def lora_problems(meta, peft, experts: tuple[str, ...], model_name: str) -> list[Problem]:
    """Why ``peft`` (``peft=lora``'s settings) cannot adapt the meta model, whose expert modules
    ``experts`` names (none when it can); it is converted in place on success."""
    from components.models.lora import LoraOptions, apply_lora, targeted_experts, targeted_linears

    patterns = None if peft.target_modules is None else tuple(peft.target_modules)
    found = problems("peft.target_modules", targeted_linears(meta, patterns)[1])
    if peft.experts and not experts:
        message = (
            f"peft.experts=true needs an MoE model: model={model_name} has no experts "
            "(model.experts names none); use peft.experts=false"
        )
        found.append(Problem(key="peft.experts", message=message))
    elif peft.experts:
        found += problems("peft.experts", targeted_experts(meta, experts)[1])
    if not found:
        adapted = tuple(experts) if peft.experts else ()
        shapes = dict(rank=1, alpha=1.0, dropout=0.0)
        apply_lora(meta, LoraOptions(**shapes, target_modules=patterns, experts=adapted), seed=0)
    return found


def _model_folder(pretrained_path: str | None) -> Path:
    if pretrained_path is None:  # model.source=smollm2
        from components.models.smollm2 import smollm2_folder

        return smollm2_folder()
    return resolve_model_folder(
        pretrained_path
    )  # a local folder, or a Hub id from the cache (or downloaded)


def checked_plan(settings: Config, dims: ParallelDims, config, meta) -> tuple[dict, list[Problem]]:
    """The TP plan at ``dims.tp`` checked on the meta model: (the style each module gets, its
    problems); ({}, []) at tp=1."""
    from components.distributed.tp_plan import check_plan
    from components.models.families import plan_for

    if dims.tp == 1:
        return {}, []
    experts, routers = moe_patterns(config, settings.model.experts, settings.model.routers)
    try:
        plan = plan_for(config, settings.sp, meta)
        styles, errors = check_plan(meta, config, plan, dims.tp, (*experts, *routers), sizes=False)
    except ValueError as error:  # no plan, given or derived
        return {}, [Problem(key="model", message=str(error))]
    return styles, problems("model", errors)


def plan_problems(
    settings: Config, dims: ParallelDims, config, meta, plan_found: list[Problem] | None = None
) -> list[Problem]:
    """The TP plan's problems (``plan_found``, :func:`checked_plan`'s, else checked here) and the
    model sizes tp must divide (key ``tp``), then expert parallelism."""
    from components.distributed.context_parallel import attention_problems
    from components.distributed.tp_plan import tp_size_errors
    from components.moe import check_expert_parallel, expert_modules
    from components.moe.structure import experts_count

    model, found = settings.model, []
    experts, routers = moe_patterns(config, model.experts, model.routers)
    found += [] if experts else problems("moe", settings.moe.dense_errors(model.name))
    found += problems("cp", attention_problems(config, dims.cp))
    if dims.tp > 1:
        found += checked_plan(settings, dims, config, meta)[1] if plan_found is None else plan_found
        found += with_tp_suggestion(problems("tp", tp_size_errors(config, dims.tp)), config)
    if dims.ep > 1:
        modules = expert_modules(meta, list(experts))
        num_experts = experts_count(meta.get_submodule(modules[0])) if modules else 0
        found += problems(
            "ep", check_expert_parallel(meta, list(experts), num_experts, dims.ep, dims.tp)
        )
    return found


def fp8_problems(
    settings: Config, dims: ParallelDims, config, meta, device_type: str, styles: dict
) -> list[Problem]:
    """``train.precision=fp8``: what the float8 linears cannot take here (an MoE model, LoRA, the
    GPU), else each converted layer's matmul dimensions at this tp (with the TP plan's
    ``styles``, :func:`checked_plan`'s)."""
    from components.models.fp8 import fp8_problems as refusals
    from components.models.fp8 import fp8_shape_errors

    experts, _ = moe_patterns(config, settings.model.experts, settings.model.routers)
    lora = settings.peft.name == "lora"
    if found := refusals(meta, bool(experts), lora, device_type):
        return problems("train.precision", found)
    found = problems("train.precision", fp8_shape_errors(meta, dims.tp, styles))
    return found + problems("train.seq_len", dims.fp8_problems(settings.train.seq_len))


def pipeline_problems(settings: Config, dims: ParallelDims, config, meta=None) -> list[Problem]:
    """``pp_schedule`` and ``pp_stages_per_rank`` that disagree; else what the layout cannot run
    of this model (``ParallelDims.model_problems``: experts with cp, what pipeline parallelism
    does not compose with yet and the stages it needs), and the meta model's structure with
    pp."""
    from components.distributed.pipeline import stage_structure_problem

    interleaved, per_rank = settings.pp_schedule == "interleaved_1f1b", settings.pp_stages_per_rank
    if interleaved != (per_rank > 1):
        message = f"pp_schedule={settings.pp_schedule} with pp_stages_per_rank={per_rank}: use "
        fix = "interleaved_1f1b with 2 stages per rank or more, or gpipe or 1f1b with 1"
        return [Problem(key="pp_schedule", message=message + fix)]
    work, facts = workload(settings), model_facts(settings, config)
    found = layout_problems(dims.model_problems(work, facts))
    if dims.pp > 1 and meta is not None and (why := stage_structure_problem(meta)):
        message = f"pp={dims.pp} with model type '{config.model_type}' is not supported yet ({why})"
        found.append(Problem(key="pp", message=f"{message}: use pp=1"))
    return found


def _unbuildable(config, error: Exception) -> Problem:
    """transformers' own model class fails on this config (DBRX's attention config lacks the
    ``rope_theta`` its model reads in transformers 5.23): that version's gap, not the folder's."""
    import transformers

    said = f"{type(error).__name__}: {error}".splitlines()[0]
    return Problem(
        key="model",
        message=f"model type '{config.model_type}' is not supported with transformers "
        f"{transformers.__version__}: its model class cannot be built from this config ({said})",
    )


def with_tp_suggestion(found: list[Problem], config) -> list[Problem]:
    """``found``, and when a problem is with ``tp``, one more naming the tp values that fit the
    model (those dividing its heads, KV heads and intermediate size)."""
    if not any(problem.key == "tp" for problem in found):
        return found
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    sizes = [size for key in keys if (size := getattr(config, key, 0))]
    fits = [tp for tp in range(1, min(sizes) + 1) if all(size % tp == 0 for size in sizes)]
    hint = f"tp values that fit this model: {', '.join(map(str, fits))}"
    return [*found, Problem(key="tp", message=hint)]


def data_source(settings: Config) -> tuple[DataSource | None, list[Problem]]:
    """The ``data`` group as a source (its ``_target_`` picks the kind), a local ``path`` made
    absolute."""
    from components.data import DataError, build_source

    group = settings.data.model_dump(by_alias=True)
    path = Path(str(group.get("path"))).expanduser()
    if "path" in group and (kind := _special_file(path)):
        special = f"data.path={show(group['path'])} is {kind}, not a regular file"
        return None, [Problem(key="data.path", message=f"{special}: give a data file or folder")]
    if "path" in group and path.exists():
        group["path"] = str(path.absolute())
    elif "path" in group and group["path"].startswith(("~", ".", "/")):
        missing = f"data.path={show(group['path'])} does not exist: give a data file or folder"
        return None, [Problem(key="data.path", message=missing)]
    try:
        return build_source(group), []
    except DataError as error:
        return None, [Problem(key="data", message=str(error))]


def _special_file(path: Path) -> str | None:
    """What ``path`` is when it exists but is neither a file nor a folder (``/dev/zero``, a FIFO,
    which a reader would read forever or wait on), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), None)


def _notes(settings: Config, dims: ParallelDims, output: Path, per_run: bool, warmup: int) -> None:
    """What the checks changed or found, once (on rank 0 under torchrun), as ``note:`` lines."""
    if per_run and settings.checkpoint.resume == "auto":
        say(
            f"note: checkpoint.resume=auto finds nothing in {output}, a new folder per run: to "
            "continue a run, give its folder as output_dir=..."
        )
    if warmup < settings.train.warmup_steps:
        cut = f"train.warmup_steps={settings.train.warmup_steps} is cut to the run's {warmup} steps"
        say(f"note: {cut}")
    for unread in unread_keys(settings, dims):
        say(f"note: {unread}")


def unread_keys(settings: Config, dims: ParallelDims) -> list[str]:
    """The keys set to something this run's layout never reads, each said (never silently
    ignored): they are harmless, and right in another layout (a sweep over tp, a dry run)."""
    unread = []
    if settings.sp and dims.tp == 1:
        unread.append(
            "sp=true changes nothing at tp=1: sequence parallelism splits the norms' sequence over "
            "the TP ranks, and there is one"
        )
    if settings.train.fp8_recipe != "tensorwise" and settings.train.precision != "fp8":
        recipe = f"train.fp8_recipe={settings.train.fp8_recipe}"
        unread.append(f"{recipe} is read with train.precision=fp8 only: this run has none")
    if settings.device_memory_gib is not None and not settings.dry_run:
        unread.append(
            f"device_memory_gib={settings.device_memory_gib:g} is read by dry_run=true only "
            "(whether the planned layout fits): this run trains on the device it has"
        )
    unread += _unread_pipeline_keys(settings, dims)
    if settings.moe.shard_experts and dims.ep == 1:
        unread.append(
            "moe.shard_experts=true changes nothing at ep=1: the experts are not split by expert "
            "(with dp > 1, FSDP shards them like every other weight)"
        )
    elif settings.moe.shard_experts and dims.ep_shard == 1:
        unread.append(
            f"moe.shard_experts=true changes nothing at ep={dims.ep} on {dims.world_size} ranks: "
            "each expert has one copy, with nothing to shard it over"
        )
    copies = dims.ep > 1 and dims.ep_shard > 1 and not settings.moe.shard_experts
    if settings.debug.check_replicas_every and dims.tp == 1 and not copies:
        unread.append(
            f"debug.check_replicas_every={settings.debug.check_replicas_every} compares nothing "
            "here: at tp=1 there are no TP replicas (nor experts copied over ep_shard)"
        )
    if started_by_launcher():
        local = os.environ.get("LOCAL_WORLD_SIZE", "?")
        if settings.nproc is not None:
            started = f"torchrun started {local} ranks here (its --nproc-per-node)"
            unread.append(f"nproc={settings.nproc} is not read under torchrun: {started}")
        if settings.max_restarts:
            theirs = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
            unread.append(
                f"max_restarts={settings.max_restarts} is the recipe's own launcher's and is not "
                f"read under torchrun, which restarts the ranks itself (here --max-restarts="
                f"{theirs}): pass --max-restarts={settings.max_restarts} to torchrun"
            )
    return unread


def _unread_pipeline_keys(settings: Config, dims: ParallelDims) -> list[str]:
    """``pp_schedule`` and ``pp_stages_per_rank`` away from their defaults (conf/config.yaml's) at
    pp=1, which has no pipeline: one line each. A dry run reads them for a pp it suggests."""
    if dims.pp > 1 or settings.dry_run:
        return []
    pipeline = (("pp_schedule", "1f1b"), ("pp_stages_per_rank", 1))
    return [
        f"{key}={value} is read with pp > 1 only: this run has pp=1"
        for key, default in pipeline
        if (value := getattr(settings, key)) != default
    ]


def _refuse(found: list[Problem]) -> None:
    """Stop planning with ``found``, if any: :class:`ConfigError` carries them to ``fail``."""
    if found:
        raise ConfigError(found)


def check(
    cfg: DictConfig, output_dir: str | None = None, hydra_run_dir: str | None = None
) -> Checked:
    """Every check that needs no effect, all problems at once (ConfigError): config in, decisions
    out; nothing is written, tokenized or trained, and ``cfg`` is left as it was. ``output_dir`` is
    a sweep job's folder; ``hydra_run_dir`` the run dir Hydra was given."""
    settings, found = _validated(cfg)
    _refuse(found)
    from components.runtime.output_checks import (  # after the schema: a bad key is refused fast
        check_output_dir,
        explicit_checkpoint_errors,
        where_errors,
    )

    train = settings.train
    warmup = min(train.warmup_steps, train.max_steps)  # a longer one is cut to the run, with a note
    output = Path(output_dir or settings.output_dir).expanduser().absolute()
    per_run = "${now:" in str(OmegaConf.to_container(cfg, resolve=False)["output_dir"])
    if per_run and output_dir is None:  # two runs in one second: the second gets DATE_TIME_2
        output = unused_folder(output)
    gpus = visible_gpus()  # NVML's count: CUDA starts in the ranks, never before the fork
    device_type = "cuda" if gpus else "cpu"
    found, fault = _option_problems(settings, warmup, output, device_type)
    dims, size_problems = check_sizes(settings, device_type, gpus)
    size_problems += _fault_layout_problems(fault, dims)
    resume = explicit_checkpoint_errors(settings.checkpoint.resume)
    model_path, config, model_problems = resolve_model(settings, dims, device_type)
    source, data_problems = data_source(settings)
    found += size_problems + resume + check_output_dir(output) + model_problems + data_problems
    _refuse(found + where_errors(output, hydra_run_dir, per_run, started_by_launcher()))
    _notes(settings, dims, output, per_run, warmup)
    decided = dict(warmup_steps=warmup, loss_chunk_tokens=train.loss_chunk_tokens or 0)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    return Checked(
        settings=settings.model_copy(update=dict(train=train.model_copy(update=decided))),
        output_dir=output,
        dims=dims,
        device_type=device_type,
        cpu_threads=cpu_threads_per_rank(settings.cpu_threads, local_ranks),
        model_path=model_path,
        model_config=config,
        source=source,
        fault=fault,
        config_yaml=_config_yaml(cfg, output),
    )


def _validated(cfg: DictConfig) -> tuple[Config | None, list[Problem]]:
    """The schema's reading of the composed config: interpolations, types, ranges, known keys."""
    try:
        return validate(cfg), []
    except SchemaError as error:
        return None, [Problem(key="config", message=str(error))]


def _option_problems(
    settings: Config, warmup: int, output: Path, device_type: str
) -> tuple[list[Problem], Fault | None]:
    """(problems, the debug fault): the optimizer's class and options, the logger's (its values
    too, for a run into ``output``), the schedule's, ``debug.fault`` and ``profile`` (on
    ``device_type``'s backend), in that order."""
    from components.debug.faults import fault_backend_errors, parse_fault
    from components.training.profiler import profile_errors
    from components.training.schedule import check_schedule

    optim = settings.optim
    errors = check_target("optim", optim.target, optim.options(), torch.optim.Optimizer, {"params"})
    errors = errors or check_optimizer(optim.target, optim.options())  # its own checks: betas, ...
    found = problems("optim", errors)
    logger, train, schedule = settings.logger, settings.train, settings.schedule
    missing = check_logger_available(logger.target)
    fixed = {"output_dir", "first_step"}
    found += problems(
        "logger",
        [missing]
        if missing
        else check_target("logger", logger.target, logger.options(), object, fixed)
        or check_logger_options(logger.target, logger.options(), output),
    )
    found += problems(
        "schedule", check_schedule(schedule.name, warmup, train.max_steps, schedule.options())
    )
    try:
        fault = parse_fault(settings.debug.fault)
    except ValueError as error:
        fault, found = None, [*found, Problem(key="debug.fault", message=str(error))]
    found += problems("debug.fault", fault_backend_errors(fault, device_type))
    profile = settings.profile  # a range past stop_after is the resumed invocation's
    asked = (profile.steps, profile.memory, train.max_steps, device_type)
    found += problems("profile", profile_errors(*asked))
    found += problems("peft", settings.peft.errors())
    return found + restart_problems(settings), fault


def _fault_layout_problems(fault: Fault | None, dims: ParallelDims | None) -> list[Problem]:
    from components.debug.faults import fault_layout_errors

    return problems("debug.fault", fault_layout_errors(fault, dims.tp)) if dims else []


def restart_problems(settings: Config) -> list[Problem]:
    """``max_restarts`` restarts the recipe's own launcher's ranks, which continue from the last
    complete checkpoint: it needs ``checkpoint.resume=auto``. Under torchrun (whose own
    ``--max-restarts`` restarts the ranks there) it is not read, and said so in a note: a refusal
    there would end in torchrun's own failure report, once per restart."""
    restarts = settings.max_restarts
    if not restarts or started_by_launcher():
        return []
    if settings.checkpoint.resume != "auto":
        resume = show(settings.checkpoint.resume)
        why = f"max_restarts={restarts} needs checkpoint.resume=auto (got {resume}): restarted "
        message = f"{why}ranks continue from the last complete checkpoint in output_dir"
        return [Problem(key="max_restarts", message=message)]
    return []


def _config_yaml(cfg: DictConfig, output: Path) -> str:
    """The run's config (without the ``hydra`` node) as YAML, with ``output_dir`` a sweep job's own
    folder: what checkpoint.resume=auto will be run with."""
    body = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    body.output_dir = str(output)
    return OmegaConf.to_yaml(body, resolve=True)
