"""The config composed from the command line with Hydra (``conf/``: a recipe's primary config and
its groups), read by the schema; where Hydra would advise a ``+key`` that the recipe then refuses,
the advice says the refusal and the known key of the closest name instead.
"""

import difflib
import functools
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.models.configs import config_errors
from components.problems import Problem, problems
from components.runtime.cli import compose_config, dotted_keys
from components.targets import check_target
from recipes.distill_schema import DistillConfig
from recipes.dpo_schema import DpoConfig
from recipes.schema import Config
from recipes.validate import SchemaError, validate

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str]) -> DictConfig:
    """The recipe's config composed from ``overrides`` (``conf/``), or one ``error:`` line."""
    return compose_config(CONF_DIR, overrides, advise=_append_advice)


def compose_dpo(overrides: list[str]) -> DictConfig:
    """``recipes/dpo.py``'s config (``conf/dpo.yaml``) composed from ``overrides``."""
    advise = functools.partial(_append_advice, name="dpo", schema=DpoConfig)
    return compose_config(CONF_DIR, overrides, advise=advise, name="dpo")


def compose_distill(overrides: list[str]) -> DictConfig:
    """``recipes/distill.py``'s config (``conf/distill.yaml``) composed from ``overrides``."""
    advise = functools.partial(_append_advice, name="distill", schema=DistillConfig)
    return compose_config(CONF_DIR, overrides, advise=advise, name="distill")


def _append_advice(
    key: str, overrides: list[str], message: str, name: str = "config", schema=Config
) -> str | None:
    """For Hydra's "Could not override 'train.max_stpes'. To append to your config use
    +train.max_stpes=5": None (Hydra's advice stands) when that ``+`` override then passes the
    checks; else what it would be refused with, and the known key of the closest name. ``key``
    is Hydra's: the first unknown part of the override's key (``trian`` of trian.max_steps=3)."""
    names = [override.partition("=")[0] for override in overrides]
    given = [name == key or name.startswith(f"{key}.") for name in names]
    full = next((name for name, is_key in zip(names, given, strict=True) if is_key), key)
    appended = [f"+{o}" if is_key else o for o, is_key in zip(overrides, given, strict=True)]
    rest = [o for o, is_key in zip(overrides, given, strict=True) if not is_key]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            appended_config = hydra_compose(config_name=name, overrides=appended)
            settings, refused = validated(appended_config, schema)
            known = dotted_keys(OmegaConf.to_container(hydra_compose(name, overrides=rest)))
    except (HydraException, OmegaConfBaseException):
        return None  # Hydra would refuse the + too: its own words
    refused = refused or _open_group_problems(settings)
    named = dict.fromkeys([full, key])  # the checks name the key, or its unknown section
    why = [problem.message for name in named for problem in refused if name in problem.message]
    if not why:
        return None
    close = difflib.get_close_matches(full, known, n=1, cutoff=0.75)
    meant = f"; did you mean {close[0]}?" if close else ""
    refusal = why[0].splitlines()[0]
    return f"Could not override '{full}', and +{full} is refused too: {refusal}{meant}"


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


def validated(
    cfg: DictConfig, schema: type[Config] = Config
) -> tuple[Config | None, list[Problem]]:
    """The schema's reading of the composed config: interpolations, types, ranges, known keys."""
    try:
        return validate(cfg, schema), []
    except SchemaError as error:
        return None, [Problem(key="config", message=str(error))]
