"""The command line of a Hydra recipe: plain overrides are composed here
(:func:`compose_config`), so that a composition error is one ``error:`` line; anything starting
with ``-`` (``--multirun``, ``--cfg``, ``--hydra-help``) goes to ``hydra.main``
(:func:`hydra_command_line`), each sweep job into its own folder.

``run(cfg, job_dir, hydra_run_dir)`` is the recipe's: ``job_dir`` is a sweep job's folder,
``hydra_run_dir`` a ``hydra.run.dir`` the user gave (checked to agree with ``output_dir``).
"""

import importlib
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.utils import get_args_parser  # hydra.main's own parser of the command line
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from components.problems import Problem
from components.runtime.problems import fail
from components.runtime.sweep import Sweep

Job = Callable[[DictConfig, str | None, str | None], None]
# (the key Hydra could not override, the overrides, its message) -> a better message, or None
Advise = Callable[[str, list[str], str], str | None]


def dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    """Every key of a composed config (as a plain dict) as a dotted path, groups and leaves: the
    names an unknown key's advice picks the closest of."""
    keys = []
    for name, value in tree.items():
        keys.append(f"{prefix}{name}")
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{name}.")
    return keys


def compose_config(
    conf_dir: Path, overrides: list[str], advise: Advise | None = None, name: str = "config"
) -> DictConfig:
    """Compose the primary config ``name`` (a recipe's) like ``hydra.main`` would (with the
    ``hydra`` node), or fail with one ``error:`` line: a missing group option lists the group's
    options; an override of an unknown key gets ``advise``'s message when it has one."""
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return hydra_compose(config_name=name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:
        fail([Problem(key="overrides", message=composition_message(error, overrides, advise))])
    except ValueError as error:  # Hydra's "Config group override must be a string or a list"
        fail([Problem(key="overrides", message=group_value_message(conf_dir, overrides, error))])


def group_value_message(conf_dir: Path, overrides: list[str], error: ValueError) -> str:
    """What a config group (``optim``, ``peft``) given a value that names no option (a number,
    null, true) should be: one of its options; Hydra's own words for any other ValueError."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    for written, override in zip(overrides, parsed, strict=True):
        group, value = override.key_or_group, override.value()
        options = sorted(path.stem for path in (conf_dir / group).glob("*.yaml"))
        if options and not isinstance(value, str | list):
            return (
                f"{group}={written.partition('=')[2]} is not valid: {group} is a "
                f"config group: choose one of its options, {group}= takes one of "
                f"{', '.join(options)}"
            )
    return str(error)


def composition_message(error: Exception, overrides: list[str], advise: Advise | None) -> str:
    """Hydra's message, its first paragraph alone, with what its exception carries said plainly."""
    message = str(error) or str(error.__cause__)
    first = message.strip().split("\n\n")[0]
    if isinstance(error, MissingConfigException) and error.options:
        group = str(error.missing_cfg_file).partition("/")[0]
        return f"{first}: {group}= takes one of {', '.join(sorted(error.options))}"
    cause = error.__cause__
    if advise is not None and isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return advise(str(cause.full_key), overrides, message) or message
    return message


def hydra_options(arguments: list[str]) -> bool:
    """Whether the command line holds an option of Hydra's own (``--hydra-help``, ``--cfg job``,
    ``--multirun``, ...): those go to :func:`hydra_command_line`, plain overrides to
    :func:`compose_config`."""
    return any(argument.startswith("-") for argument in arguments)


def prints_only(arguments: list[str]) -> bool:
    """Whether Hydra answers this command line by printing alone (``--help``, ``--cfg``,
    ``--info``, shell completion): no run, no rank."""
    return any(argument.split("=")[0] in PRINTING_OPTIONS for argument in arguments)


PRINTING_OPTIONS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i")
PRINTING_OPTIONS += ("--shell-completion", "-sc", "--version", "--resolve", "-p", "--package")


def given_run_dir(arguments: list[str], cfg: DictConfig) -> str | None:
    """``hydra.run.dir`` when the user gave it (checked to agree with ``output_dir``), else None:
    the default is ``${output_dir}``, and its ``${now:...}`` read a moment later can name the next
    second's folder."""
    given = any(argument.startswith("hydra.run.dir=") for argument in arguments)
    return cfg.hydra.run.dir if given else None


def refuse_as_the_recipe(
    conf_dir: Path, arguments: list[str], compose: str, name: str = "config"
) -> None:
    """Before Hydra's own entry (``--cfg job``, ...): overrides that do not compose (with the
    recipe's primary config ``name``) end as the recipe's ``compose`` ends them, in one ``error:``
    line (for a misspelt key, the known key of the closest name), not as Hydra's page, whose
    advice (``+key=...``) the recipe then refuses. A sweep (``--multirun``) or another config is
    Hydra's alone."""
    given = get_args_parser().parse_args(arguments)
    renamed = given.config_name not in (None, name)
    other_config = given.config_path or given.config_dir or renamed
    if given.multirun or other_config:
        return
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            hydra_compose(config_name=name, overrides=given.overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError):  # ValueError: a group's value
        named(compose)(given.overrides)  # its error: line, and exit 2


def named(function: str) -> Callable:
    """The function ``module:function`` names, imported now."""
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


def hydra_command_line(conf_dir: Path, run: Job, name: str = "config") -> None:
    """Hydra's own command line (``hydra.main``) over ``run`` and the primary config ``name``: its
    ``--help`` and ``--cfg``; with ``--multirun`` every job runs in its own folder, and the sweep
    ends with every job's status."""
    sweep = Sweep()
    try:
        _hydra_entry(conf_dir, run, sweep, name)()
    finally:
        sweep.end()


def _hydra_entry(conf_dir: Path, run: Job, sweep: Sweep, name: str) -> Callable[[], None]:
    """``hydra.main`` over ``run``: each sweep job writes to its own folder and is noted in
    ``sweep``; a plain run writes to ``output_dir`` or to a run dir the user gave."""

    def task(cfg: DictConfig) -> None:
        job = HydraConfig.get()
        run_dir_given = any(item.startswith("hydra.run.dir=") for item in job.overrides.hydra)
        if job.mode == RunMode.MULTIRUN:
            overrides = list(job.overrides.task)
            sweep.run_job(job.job.num, overrides, lambda: run(cfg, job.runtime.output_dir, None))
        elif not run_dir_given:  # output_dir (as Hydra resolved it: the same date and time)
            run(cfg, job.runtime.output_dir, None)
        else:
            run(cfg, None, job.run.dir)

    task.__wrapped__ = run  # Hydra names the job (and finds its file) by the recipe's function
    return hydra.main(config_path=str(conf_dir), config_name=name, version_base="1.3")(task)
