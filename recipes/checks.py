"""Every check, once per launch, before any rank starts; the result is the run plan
(``recipes/plan.py``).

Every check returns problems (``recipes/problems.py``); ``fail`` prints them as one ``error:`` line
on stderr (joined by "; ", each naming the key, its value and what would work) and exits 2, in
seconds: no traceback wall, no rank left waiting. Under torchrun every rank runs the checks but only
rank 0 prints (``say``).

In order: Hydra composition (:func:`compose`); interpolations, every key's type, range and the set
of known keys (``recipes/schema.py``); the optimizer's class and options; sizes that do not factor
the world; batch sizes and (with ``sp``) the sequence length that do not divide;
``checkpoint.resume``; ``output_dir``; the model (folder or config, plan divisibility, experts,
``seq_len`` within its positions); the data and the validation split; and, once the tokenizer
exists, that every record keeps answer tokens within ``train.seq_len``.
"""

from __future__ import annotations  # the annotations name classes imported only when needed

import difflib
import math
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.distributed.mesh import ParallelDims, resolve_parallel_dims
from components.models.configs import build_config, config_errors
from components.models.families import moe_patterns
from components.models.hub import resolve_model_folder
from components.runtime.launch import cpu_threads_per_rank, started_by_launcher
from components.runtime.output_dir import OutputDirLock, RunRecord, unused_folder
from components.targets import check_target
from components.training.loggers import check_logger_available, check_logger_options
from components.training.optimizer import check_optimizer
from recipes.plan import RunPlan
from recipes.problems import ConfigError, Problem, fail, is_rank_zero, problems, say
from recipes.schema import Config, SchemaError, show, validate

if TYPE_CHECKING:
    from components.data import PreparedData
    from components.data.sources import DataSource
    from components.debug.faults import Fault
    from components.models.parallelize import ModelSpec

# Model, data and tokenizer modules (transformers, datasets, DTensor) are imported by the checks
# that use them: a mistyped key or a bad value is refused in about the time of `import torch`.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str]) -> DictConfig:
    """Compose like ``hydra.main`` would (with the ``hydra`` node), so that composition errors print
    as one ``error:`` line instead of Hydra's own multi-line report."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(
                config_name="config", overrides=overrides, return_hydra_config=True
            )
    except (HydraException, OmegaConfBaseException) as error:
        message = _with_group_options(str(error) or str(error.__cause__))
        fail([Problem(key="overrides", message=_append_advice(message, overrides))])


def _append_advice(message: str, overrides: list[str]) -> str:
    """Hydra's "Could not override 'train.max_stpes'. To append to your config use
    +train.max_stpes=5", kept only when that ``+`` override then passes the checks; else what it
    would be refused with, and the known key of the closest name."""
    found = re.search(
        r"Could not override '([^']+)'\.\s+To append to your config use \+(\S+)", message
    )
    if found is None:
        return message
    key = found[1]
    given = [override.partition("=")[0] == key for override in overrides]
    appended = [f"+{o}" if is_key else o for o, is_key in zip(overrides, given, strict=True)]
    rest = [o for o, is_key in zip(overrides, given, strict=True) if not is_key]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            settings, refused = _validated(hydra_compose(config_name="config", overrides=appended))
            known = _dotted_keys(OmegaConf.to_container(hydra_compose("config", overrides=rest)))
    except (HydraException, OmegaConfBaseException):
        return message  # Hydra would refuse the + too: its own words
    refused = refused or _open_group_problems(settings)
    if not (why := [problem.message for problem in refused if key in problem.message]):
        return message
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


def _with_group_options(message: str) -> str:
    """Hydra's "Could not find 'model/gpt5'" with the options the group has."""
    missing = re.search(r"Could not find '(\w+)/([^']*)'", message)
    if missing is None or not (CONF_DIR / missing[1]).is_dir():
        return message
    names = sorted(path.stem for path in (CONF_DIR / missing[1]).glob("*.yaml"))
    first, _, rest = message.strip().partition("\n\n")  # fail() shows the first paragraph alone
    return f"{first}: {missing[1]}= takes one of {', '.join(names)}\n\n{rest}"


def check_sizes(settings: Config, device_type: str) -> tuple[ParallelDims | None, list[Problem]]:
    """Parallel sizes that factor the world; batch sizes and (with sp) seq_len that divide."""
    if started_by_launcher():
        world_size = int(os.environ["WORLD_SIZE"])
    elif settings.nproc is not None:
        world_size = settings.nproc
    else:  # a dry run plans the layout asked for, whatever devices this machine has
        cuda = device_type == "cuda" and not settings.dry_run
        inner = settings.cp * settings.tp
        world_size = torch.cuda.device_count() if cuda else (settings.dp or 1) * inner
    sizes = dict(tp=settings.tp, dp=settings.dp, ep=settings.ep, cp=settings.cp)
    try:
        dims = resolve_parallel_dims(world_size, **sizes)
    except ValueError as error:
        given = settings.nproc is not None or settings.dp is not None
        if started_by_launcher() or given or device_type == "cuda":
            return None, [Problem(key="nproc", message=str(error))]
        fits = math.lcm(settings.cp * settings.tp, settings.ep)  # the smallest world to start
        how = f"start {fits} processes here with nproc={fits}, or use torchrun"
        return None, [Problem(key="nproc", message=f"{error}; {how}")]
    train, found = settings.train, []
    if train.global_batch_size % (train.micro_batch_size * dims.dp):
        fits = train.micro_batch_size * dims.dp
        found.append(
            Problem(
                key="train.global_batch_size",
                message=f"train.global_batch_size ({train.global_batch_size}) must be divisible by "
                "train.micro_batch_size "
                f"({train.micro_batch_size}) × dp ({dims.dp}): use a multiple of {fits}, e.g. "
                f"train.global_batch_size={max(fits, train.global_batch_size // fits * fits)}",
            )
        )
    if settings.sp and train.seq_len % dims.tp:
        fits = max(dims.tp, train.seq_len // dims.tp * dims.tp)
        found.append(
            Problem(
                key="train.seq_len",
                message=f"train.seq_len ({train.seq_len}) must be divisible by tp ({dims.tp}) "
                "with sp=true (each rank holds "
                f"an equal slice of the sequence): use e.g. train.seq_len={fits}",
            )
        )
    return dims, found + context_parallel_problems(settings, dims)


def context_parallel_problems(settings: Config, dims: ParallelDims) -> list[Problem]:
    """With cp > 1: ``train.seq_len`` must split into ``2·cp`` equal chunks (and, with sp, a rank's
    share into tp slices); ``train.compile`` is not supported with cp yet."""
    if dims.cp == 1:
        return []
    found, seq_len = [], settings.train.seq_len
    multiple = math.lcm(2 * dims.cp, dims.cp * dims.tp if settings.sp else 1)
    if seq_len % multiple:
        why = f"2 × cp ({2 * dims.cp})" if multiple == 2 * dims.cp else f"{multiple}"
        use = f"train.seq_len={max(multiple, seq_len // multiple * multiple)}"
        split = ", split over tp with sp=true" if settings.sp else ""
        message = (
            f"train.seq_len ({seq_len}) must be divisible by {why} with cp={dims.cp} (each cp rank "
            f"holds two of 2 × cp equal chunks{split}): use e.g. {use}"
        )
        found.append(Problem(key="train.seq_len", message=message))
    if settings.train.compile:
        message = f"train.compile=true with cp={dims.cp} is not supported yet: use cp=1"
        found.append(Problem(key="train.compile", message=message))
    return found


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
            if errors := config_errors(model.family, model.config):
                return None, None, problems("model.config", errors)
            path, config = None, build_config(model.family, model.config)
    except (ValueError, OSError, RuntimeError) as error:
        return None, None, [Problem(key="model", message=str(error))]
    found = []
    if settings.train.seq_len > config.max_position_embeddings:
        found.append(
            Problem(
                key="train.seq_len",
                message=f"train.seq_len ({settings.train.seq_len}) exceeds the model's "
                "max_position_embeddings "
                f"(model.config.max_position_embeddings={config.max_position_embeddings}): use "
                f"train.seq_len={config.max_position_embeddings} or less"
                + ("" if path else ", or raise model.config.max_position_embeddings"),
            )
        )
    splits = dims is not None and (dims.tp > 1 or dims.ep > 1)
    meta = meta_causal_lm(config) if path is not None or splits else None  # shapes only, built once
    if path is not None:
        found += problems("model", check_model_folder(path, meta) + check_tokenizer_folder(path))
    if dims is not None:
        found += _plan_problems(settings, dims, config, meta)
        try:
            experts, _ = moe_patterns(config.model_type, model.experts, model.routers)
            check_compile(settings.train.compile, device_type, bool(experts), dims.tp, settings.sp)
        except ValueError as error:
            found.append(Problem(key="train.compile", message=str(error)))
    return path, config, found


def _model_folder(pretrained_path: str | None) -> Path:
    if pretrained_path is None:  # model.source=smollm2
        from components.models.smollm2 import smollm2_folder

        return smollm2_folder()
    return resolve_model_folder(
        pretrained_path
    )  # a local folder, or a Hub id from the cache (or downloaded)


def _plan_problems(settings: Config, dims: ParallelDims, config, meta) -> list[Problem]:
    """The TP plan (and the model sizes tp must divide, key ``tp``), then expert parallelism."""
    from components.distributed.context_parallel import attention_problems
    from components.distributed.tp_plan import check_plan, plan_for, tp_size_errors
    from components.moe import check_expert_parallel

    model, found = settings.model, []
    experts, routers = moe_patterns(config.model_type, model.experts, model.routers)
    found += [] if experts else problems("moe", settings.moe.dense_errors(model.name))
    if experts and dims.cp > 1:
        moe = f"cp={dims.cp} with an MoE model (model={model.name}) is not supported yet: use cp=1"
        found.append(Problem(key="cp", message=moe))
    found += problems("cp", attention_problems(config, dims.cp))
    if dims.tp > 1:
        plan = plan_for(config, settings.sp)
        moe = (*experts, *routers)
        found += problems("model", check_plan(meta, config, plan, dims.tp, moe, sizes=False)[1])
        found += with_tp_suggestion(problems("tp", tp_size_errors(config, dims.tp)), config)
    if dims.ep > 1:
        num_experts = getattr(config, "num_experts", None) or getattr(
            config, "num_local_experts", 0
        )
        found += problems("ep", check_expert_parallel(meta, list(experts), num_experts, dims.ep))
    return found


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
    if "path" in group and path.exists():
        group["path"] = str(path.absolute())
    elif "path" in group and group["path"].startswith(("~", ".", "/")):
        missing = f"data.path={show(group['path'])} does not exist: give a data file or folder"
        return None, [Problem(key="data.path", message=missing)]
    try:
        return build_source(group), []
    except DataError as error:
        return None, [Problem(key="data", message=str(error))]


def _tokenizer_dir(
    settings: Config, source: DataSource, model_path: Path | None, config, dims: ParallelDims
) -> tuple[Path | None, list[Problem]]:
    """The model's tokenizer folder, or one trained on the data, whose vocabulary then sizes the
    model (and is checked against the TP plan)."""
    from transformers import AutoTokenizer

    from components.data import DataError, cached_tokenizer
    from components.models import meta_causal_lm

    try:
        tokenizer_dir = model_path or cached_tokenizer(
            source, Path(settings.cache_dir).expanduser().absolute()
        )
    except DataError as error:
        return None, [Problem(key="data", message=f"data: {error}")]
    if model_path is None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
        if not (settings.dry_run and config.vocab_size > len(tokenizer)):  # a dry run: a real one's
            config.vocab_size = len(tokenizer)
        if dims.tp > 1:
            return tokenizer_dir, _plan_problems(settings, dims, config, meta_causal_lm(config))
    return tokenizer_dir, []


def prepare_run_data(
    settings: Config, source: DataSource, tokenizer_dir: Path, dims: ParallelDims
) -> tuple[PreparedData | None, list[Problem]]:
    """Tokenize once (or reuse the cache) and check the splits."""
    from components.data import DataError, prepare_data

    train, cache = settings.train, Path(settings.cache_dir).expanduser().absolute()
    try:
        prepared = prepare_data(
            source,
            tokenizer_dir,
            seq_len=train.seq_len,
            packing=train.packing,
            seed=settings.seed,
            cache_root=cache,
            num_proc=max(1, min(8, os.cpu_count() or 1)),
        )
    except (DataError, ValueError) as error:
        return None, [Problem(key="data", message=f"data: {error}")]
    val_rows = prepared.val.num_rows if prepared.val is not None else 0
    if train.val_every and val_rows < dims.dp:
        why = f"data.val_fraction={show(source.val_fraction)} holds out {val_rows} validation rows"
        too_few = (
            f"train.val_every={train.val_every} needs validation rows for each of dp ({dims.dp}) "
            f"ranks but {why}: "
            "raise data.val_fraction or set train.val_every=0"
        )
        return None, [Problem(key="train.val_every", message=too_few)]
    if prepared.repaired:
        say(f"warning: {prepared.repaired}: made again from the data", file=sys.stderr)
    how = "reused from the cache" if prepared.reused else "written to the cache"
    rows = f"{prepared.train.num_rows} training rows, {val_rows} validation rows"
    say(f"data: tokenized data {how}: {prepared.folder} ({rows})")
    return prepared, []


def model_spec(settings: Config, config, weights: Path | None) -> ModelSpec:
    from components.models.parallelize import ModelSpec

    model, train = settings.model, settings.train
    # model.experts or model.routers null: the family's patterns
    experts, routers = moe_patterns(config.model_type, model.experts, model.routers)
    return ModelSpec(
        config=config,
        weights=weights,
        seed=settings.seed,
        sequence_parallel=settings.sp,
        experts=experts,
        routers=routers,
        precision=train.precision,
        activation_checkpointing=train.activation_checkpointing,
        compile=train.compile,
        shard_experts=settings.moe.shard_experts,
    )


def _notes(settings: Config, output: Path, per_run: bool, warmup: int) -> None:
    """What the checks changed or found, once (on rank 0 under torchrun), as ``note:`` lines."""
    if per_run and settings.checkpoint.resume == "auto":
        say(
            f"note: checkpoint.resume=auto finds nothing in {output}, a new folder per run: to "
            "continue a run, give its folder as output_dir=..."
        )
    if warmup < settings.train.warmup_steps:
        cut = f"train.warmup_steps={settings.train.warmup_steps} is cut to the run's {warmup} steps"
        say(f"note: {cut}")


def _refuse(found: list[Problem]) -> None:
    """Stop planning with ``found``, if any: :class:`ConfigError` carries them to ``fail``."""
    if found:
        raise ConfigError(found)


def plan_run(
    cfg: DictConfig, output_dir: str | None = None, hydra_run_dir: str | None = None
) -> tuple[RunPlan, OutputDirLock | None]:
    """Check everything and decide everything a rank needs; raise ConfigError with every problem.
    Also returns the lock on ``output_dir`` (held by this process, None on torchrun ranks other than
    0). ``output_dir`` is a sweep job's folder; ``hydra_run_dir`` the run dir Hydra was given."""
    settings, found = _validated(cfg)
    _refuse(found)
    from recipes.outputs import check_output_dir, explicit_checkpoint_errors, run_info, where_errors

    train = settings.train
    warmup = min(train.warmup_steps, train.max_steps)  # a longer one is cut to the run, with a note
    output = Path(output_dir or settings.output_dir).expanduser().absolute()
    per_run = "${now:" in str(OmegaConf.to_container(cfg, resolve=False)["output_dir"])
    if per_run and output_dir is None:  # two runs in one second: the second gets DATE_TIME_2
        output = unused_folder(output)
    found, fault = _option_problems(settings, warmup, output)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dims, size_problems = check_sizes(settings, device_type)
    resume = explicit_checkpoint_errors(settings.checkpoint.resume)
    model_path, config, model_problems = resolve_model(settings, dims, device_type)
    source, data_problems = data_source(settings)
    found += size_problems + resume + check_output_dir(output) + model_problems + data_problems
    _refuse(found + where_errors(output, hydra_run_dir, per_run, started_by_launcher()))
    _notes(settings, output, per_run, warmup)  # checked: what the plan decided
    tokenizer_dir, found = _tokenizer_dir(settings, source, model_path, config, dims)
    _refuse(found)
    # bad data is refused before the folder is claimed
    data, found = prepare_run_data(settings, source, tokenizer_dir, dims)
    _refuse(found)
    info = run_info(settings, config, data.tokenizer_digest, source)
    (lock, resume_from, record), found = _claim_output_dir(settings, output, info)
    _refuse(found)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    plan = RunPlan(
        dims=dims,
        device_type=device_type,
        cpu_threads=cpu_threads_per_rank(settings.cpu_threads, local_ranks),
        seed=settings.seed,
        collective_timeout=timedelta(minutes=settings.collective_timeout_minutes),
        output_dir=output,
        model=model_spec(settings, config, model_path),
        base_model=settings.model.pretrained_path,
        tokenizer_dir=Path(tokenizer_dir),
        data=data,
        pad_multiple=pad_multiple(settings.sp, dims),
        train=train.model_copy(
            update=dict(warmup_steps=warmup, loss_chunk_tokens=train.loss_chunk_tokens or 0)
        ),
        optim=settings.optim,
        schedule=settings.schedule,
        checkpoint=settings.checkpoint,
        logger=settings.logger,
        moe=settings.moe,
        check_replicas_every=settings.debug.check_replicas_every,
        max_restarts=settings.max_restarts,
        dry_run=settings.dry_run,
        device_memory_gib=settings.device_memory_gib,
        resume_from=resume_from,
        run_id=record.run_id if record is not None else None,
        run_info=info,
        fault=fault,
        config_yaml=_config_yaml(cfg, output),
    )
    return plan, lock


def pad_multiple(sequence_parallel: bool, dims: ParallelDims) -> int:
    """What a micro-batch's length is rounded up to: 8, and with sp an equal slice per TP rank, and
    with cp 2 × cp equal chunks (with sp too, a cp rank's share in tp slices)."""
    tp = dims.tp if sequence_parallel else 1
    return math.lcm(8 * tp, 2 * dims.cp if dims.cp > 1 else 1, dims.cp * tp)


def _validated(cfg: DictConfig) -> tuple[Config | None, list[Problem]]:
    """The schema's reading of the composed config: interpolations, types, ranges, known keys."""
    try:
        return validate(cfg), []
    except SchemaError as error:
        return None, [Problem(key="config", message=str(error))]


def _option_problems(
    settings: Config, warmup: int, output: Path
) -> tuple[list[Problem], Fault | None]:
    """(problems, the debug fault): the optimizer's class and options, the logger's (its values
    too, for a run into ``output``), the schedule's and ``debug.fault``, in that order."""
    from components.debug.faults import parse_fault
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
    return found + restart_problems(settings), fault


def restart_problems(settings: Config) -> list[Problem]:
    """``max_restarts`` restarts the recipe's own launcher's ranks, which continue from the last
    complete checkpoint: it needs ``checkpoint.resume=auto``, and under torchrun (whose own
    ``--max-restarts`` restarts the ranks there) it is not read."""
    restarts = settings.max_restarts
    if not restarts:
        return []
    if started_by_launcher():
        why = f"max_restarts={restarts} is the recipe's own launcher's: under torchrun pass "
        return [Problem(key="max_restarts", message=f"{why}--max-restarts={restarts} to torchrun")]
    if settings.checkpoint.resume != "auto":
        resume = show(settings.checkpoint.resume)
        why = f"max_restarts={restarts} needs checkpoint.resume=auto (got {resume}): restarted "
        message = f"{why}ranks continue from the last complete checkpoint in output_dir"
        return [Problem(key="max_restarts", message=message)]
    return []


def _claim_output_dir(
    settings: Config, output: Path, info: dict[str, Any]
) -> tuple[tuple[OutputDirLock | None, Path | None, RunRecord | None], list[Problem]]:
    """((lock, checkpoint to resume from, run record), problems): rank 0 owns ``output`` (locks it,
    resumes from it), the other ranks and a dry run only choose the checkpoint. The last step that
    can refuse the run: nothing after it leaves a claimed folder behind."""
    from recipes.outputs import OwnershipError, choose_checkpoint, own_output_dir

    try:
        if is_rank_zero() and not settings.dry_run:  # rank 0 owns it
            return own_output_dir(settings, output, info), []
        resume, max_steps = settings.checkpoint.resume, settings.train.max_steps
        chosen = choose_checkpoint(resume, max_steps, output / "checkpoints", info)
        return (None, chosen, None), []
    except OwnershipError as error:
        return (None, None, None), [error.problem()]


def _config_yaml(cfg: DictConfig, output: Path) -> str:
    """The run's config (without the ``hydra`` node) as YAML, with ``output_dir`` a sweep job's own
    folder: what checkpoint.resume=auto will be run with."""
    body = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    body.output_dir = str(output)
    return OmegaConf.to_yaml(body, resolve=True)
