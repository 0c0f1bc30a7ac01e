"""Hugging Face configs of models built from a config (no checkpoint): a family's class plus explicit sizes.

The sizes are data, not code: the recipe takes them from ``model.config`` (``conf/model/<family>.yaml``,
overridable on the command line), and :func:`tiny_config` reads the same files for tests and benchmarks, so
the tiny models tests use are the ones the recipe runs. Every tiny size keeps heads, kv heads and experts
(8, 4, 8) divisible by 1, 2 and 4.
"""

import functools
import inspect
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from transformers import PretrainedConfig

from components.models.families import FAMILIES

# Read by every family's attention (``getattr(config, "head_dim", ...)``) though not every config declares it.
READ_BY_MODELS = frozenset({"head_dim"})
MODEL_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"


@functools.cache
def known_keys(family: str) -> frozenset[str]:
    """Every key a ``family`` config accepts: its attributes, its constructor's parameters and settable
    properties (``attn_implementation``)."""
    config_class = FAMILIES[family].config_class()
    members = inspect.getmembers(config_class)
    settable = {name.lstrip("_") for name, value in members if isinstance(value, property) and value.fset}
    parameters = set(inspect.signature(config_class.__init__).parameters) - {"self"}
    return frozenset(config_class().to_dict()) | parameters | settable | READ_BY_MODELS


def config_errors(family: str | None, sizes: dict[str, Any]) -> list[str]:
    """Why ``family`` with ``sizes`` cannot be built (an unknown family, keys the config does not have)."""
    if family not in FAMILIES:
        return [f"model.family={family!r} is not a known family: use one of {', '.join(sorted(FAMILIES))}"]
    unknown = sorted(set(sizes) - known_keys(family))
    config_name = FAMILIES[family].config_name
    return [f"model.config.{name} is not a key of {config_name}: remove it" for name in unknown]


def build_config(family: str, sizes: dict[str, Any]) -> PretrainedConfig:
    """The ``family`` config with exactly ``sizes`` set (the rest are the class defaults).

    Raises:
        ValueError: If the family is unknown or a key is not one of its config's (see :func:`config_errors`).
    """
    errors = config_errors(family, sizes)
    if errors:
        raise ValueError("; ".join(errors))
    return FAMILIES[family].config_class()(**sizes)


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``conf/model/<family>.yaml`` (the recipe's default sizes); ``overrides`` win."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {', '.join(sorted(FAMILIES))}")
    sizes = OmegaConf.to_container(OmegaConf.load(MODEL_CONF_DIR / f"{family}.yaml").config)
    return build_config(family, {**sizes, **overrides})
