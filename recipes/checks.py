"""The pre-flight: every check that needs no effect, once per launch, before any rank starts:
config in, problems out (``components/problems.py``), all at once; nothing written, tokenized or
trained. Each owner checks its own part and this module collects their lines: the schema's sections
(``recipes/schema.py``), the layout (``components/distributed/layout.py``), the model
(``components/models/checks.py``; experts ``components/moe/checks.py``), the data
(``components/data/checks.py``), ``output_dir`` and ``checkpoint.resume`` (``components/runtime``).
The effects follow in ``recipes/prepare.py``, once.
"""

from __future__ import annotations  # the annotations name classes imported only when needed

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from components.distributed.layout import LayoutError, ModelFacts, ParallelDims
from components.problems import Problem, problems
from components.runtime.launch import started_by_launcher
from components.runtime.launch_checks import gpu_count_problems, torchrun_unread_keys
from components.runtime.output_dir import run_output_folder
from components.runtime.problems import ConfigError, say
from components.runtime.world import cpu_threads_per_rank, visible_gpus
from recipes.compose import mix_kinds, validated
from recipes.plan import (
    Checked,
    degrees,
    model_choice,
    model_facts,
    model_use,
    optimizer_facts,
    workload,
)
from recipes.schema import Config

if TYPE_CHECKING:  # the model checks import transformers' models: after the schema has passed
    from components.models.checks import CheckedModel

# The checks of a frozen model run beside the trained one (distillation's teacher): given the
# settings, layout, device type and the trained model as checked, the frozen model as checked, its
# problems reported with the trained model's, every problem at once.
Beside = Callable[[Config, ParallelDims | None, str, "CheckedModel"], "CheckedModel"]
# Model, data and tokenizer modules (transformers, datasets, DTensor) are imported by the checks
# that use them: a mistyped key or a bad value is refused in about the time of `import torch`.


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
    return dims, dims.problems(work)


def check(
    cfg: DictConfig,
    output_dir: str | None = None,
    hydra_run_dir: str | None = None,
    schema: type[Config] = Config,
) -> Checked:
    """Every check that needs no effect, all problems at once (ConfigError): config in, decisions
    out; nothing is written, tokenized or trained, and ``cfg`` is left as it was. ``output_dir`` is
    a sweep job's folder; ``hydra_run_dir`` the run dir Hydra was given; ``schema`` the recipe's
    (``Config``, ``DpoConfig``)."""
    checked, _ = check_beside(cfg, output_dir, hydra_run_dir, schema)
    return checked


def check_beside(
    cfg: DictConfig,
    output_dir: str | None = None,
    hydra_run_dir: str | None = None,
    schema: type[Config] = Config,
    beside: Beside | None = None,
) -> tuple[Checked, CheckedModel | None]:
    """:func:`check`'s checks, and ``beside``'s of a frozen model (None: none): the frozen model
    as checked, returned with the run's; its problems refused with the run's, in one ConfigError."""
    settings, found = validated(cfg, schema)
    _refuse(found)
    from components.debug.faults import fault_layout_errors  # after the schema: a bad key is fast
    from components.runtime.output_checks import (
        check_output_dir,
        explicit_checkpoint_errors,
        overwritten_model_problems,
        where_errors,
    )

    train = settings.train
    warmup = min(train.warmup_steps, train.max_steps)  # a longer one is cut to the run, with a note
    written = str(OmegaConf.to_container(cfg, resolve=False)["output_dir"])
    output, per_run = run_output_folder(settings.output_dir, written, output_dir)
    gpus = visible_gpus()  # NVML's count: CUDA starts in the ranks, never before the fork
    device_type = "cuda" if gpus else "cpu"
    found, fault = settings.option_problems(warmup, output, device_type)
    found += restart_problems(settings)
    dims, size_problems = check_sizes(settings, device_type, gpus)
    size_problems += problems("debug.fault", fault_layout_errors(fault, dims.tp)) if dims else []
    size_problems += optim_layout_problems(settings, dims) if dims else []
    resume = explicit_checkpoint_errors(settings.checkpoint.resume)
    checked = model_problems(settings, dims, device_type)
    frozen = beside(settings, dims, device_type, checked) if beside else None
    source, data_problems = _checked_data(settings)
    overwrite = overwritten_model_problems(
        output, settings.overwrite_output_dir, settings.model_folders()
    )
    found += size_problems + resume + check_output_dir(output) + overwrite + checked.problems
    found += data_problems + (frozen.problems if frozen is not None else [])
    _refuse(found + where_errors(output, hydra_run_dir, per_run, started_by_launcher()))
    _notes(settings, dims, output, per_run, warmup, device_type)
    decided = dict(warmup_steps=warmup, loss_chunk_tokens=train.loss_chunk_tokens or 0)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    run = Checked(
        settings=settings.model_copy(update=dict(train=train.model_copy(update=decided))),
        output_dir=output,
        dims=dims,
        device_type=device_type,
        cpu_threads=cpu_threads_per_rank(settings.cpu_threads, local_ranks),
        model_path=checked.path,
        model_config=checked.config,
        model_awaits_fetch=checked.awaits_fetch,
        model_facts=checked.facts,
        source=source,
        fault=fault,
        config_yaml=_config_yaml(cfg, output),
    )
    return run, frozen


def _checked_data(settings: Config):
    """The data source as its checks find it (``components/data/checks.py``), and its problems."""
    from components.data.checks import checked_source  # after the schema: a bad key is fast

    data = settings.data.model_dump(by_alias=True)
    return checked_source(data, settings.preference_pairs, mix_kinds(settings.seed))


def optim_layout_problems(settings: Config, dims: ParallelDims) -> list[Problem]:
    """What the optimizer's class cannot run at this layout (``ParallelDims.optimizer_problems``)
    or precision (``components/training/optimizer.py``)."""
    from components.training.optimizer import optimizer_precision_errors

    target = settings.optim.target
    found = dims.optimizer_problems(optimizer_facts(settings), workload(settings))
    return found + problems("optim", optimizer_precision_errors(target, settings.train.precision))


def restart_problems(settings: Config) -> list[Problem]:
    """``max_restarts`` without ``checkpoint.resume=auto``; under torchrun, whose own
    ``--max-restarts`` restarts the ranks, a note instead (a refusal would end in its report)."""
    return [] if started_by_launcher() else problems("max_restarts", settings.restart_errors())


def model_problems(settings: Config, dims: ParallelDims | None, device_type: str):
    """The model checked (``components.models.checks``: a ``CheckedModel``, its notes printed),
    its experts' split (``components.moe``), the ``moe`` keys a dense model does not read, and
    what the layout cannot run of it (``ParallelDims.model_problems``)."""
    from components.models.checks import check_model
    from components.moe.checks import expert_parallel_problems, routed_experts_of

    use = model_use(settings, device_type, dims)
    checked = check_model(model_choice(settings), use, dims)
    for note in checked.notes:
        say(note)
    if not checked.complete or dims is None:
        return checked
    if not checked.experts:
        checked.problems += problems("moe", settings.moe.dense_errors(settings.model.name))
    model_type = checked.config.model_type
    checked.problems += problems("model", settings.model_errors(model_type, checked.experts))
    if checked.experts or not settings.experts_beside:  # else the frozen model's checks decide
        checked.problems += expert_parallel_problems(checked.meta, checked.experts, dims.ep)
    routed = routed_experts_of(checked.meta, checked.experts)
    checked.facts = model_facts(
        settings, checked.config, routed, checked.refusals, use.other_layouts
    )
    checked.problems += layout_model_problems(settings, dims, checked.facts)
    return checked


def layout_model_problems(settings: Config, dims: ParallelDims, facts: ModelFacts) -> list:
    """``pp_schedule`` and ``pp_stages_per_rank`` that disagree; else what the layout cannot run
    of the model of ``facts`` (``ParallelDims.model_problems``)."""
    if pipeline := settings.pipeline_errors():  # the pipeline's rules read a schedule that fits
        return problems("pp_schedule", pipeline)
    return dims.model_problems(workload(settings), facts)


def unread_keys(settings: Config, dims: ParallelDims) -> list[str]:
    """The keys this run never reads (``Config.unread_keys``), and under torchrun the recipe's
    own launcher's."""
    return settings.unread_keys(dims) + torchrun_unread_keys(settings.nproc, settings.max_restarts)


def _notes(
    settings: Config, dims: ParallelDims, output: Path, per_run: bool, warmup: int, device: str
) -> None:
    """What the checks changed or found, once (on rank 0 under torchrun), as ``note:`` lines
    (``device``: the type this run trains on)."""
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
    for offload in [] if settings.dry_run else settings.train.offload_notes(device):
        say(f"note: {offload}")


def _refuse(found: list[Problem]) -> None:
    """Stop planning with ``found``, if any: :class:`ConfigError` carries them to ``fail``."""
    if found:
        raise ConfigError(found)


def _config_yaml(cfg: DictConfig, output: Path) -> str:
    """The run's config (without the ``hydra`` node) as YAML, with ``output_dir`` a sweep job's own
    folder: what checkpoint.resume=auto will be run with."""
    body = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    body.output_dir = str(output)
    return OmegaConf.to_yaml(body, resolve=True)
