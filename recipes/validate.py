"""The composed config checked against the schema (``recipes/schema.py``): :func:`validate` gives
the :class:`Config`, or a :class:`SchemaError` whose message names every wrong key, its value as
written and what would work (the field's ``description``): an unresolvable ``${...}``, a key left
at ``???``, a wrong type or range, an unknown or missing key.
"""

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from components.problems import show
from recipes.schema import Config

EXAMPLE = re.compile(r"e\.g\. ([\w.]+=[^\s;]+)")  # a hint's example: "e.g. distill.alpha=0.5"


def _field_info(loc: tuple, schema: type[Config] = Config) -> FieldInfo | None:
    """The declaration of the field at ``loc`` of ``schema`` (within a mapping, the mapping's), or
    None when there is none."""
    model: Any = schema
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields:
            break
        info = next((f for name, f in fields.items() if part in (name, f.alias)), None)
        if info is None:
            return None
        model = info.annotation
    return info


def _field_hint(loc: tuple, schema: type[Config] = Config) -> str:
    """The ``description`` of the field at ``loc`` of ``schema`` (what would work), or "" when
    there is none."""
    info = _field_info(loc, schema)
    return (info.description or "") if info is not None else ""


def describe(
    error: ValidationError, given: dict | None = None, schema: type[Config] = Config
) -> list[str]:
    """One line per wrong key (the first error of each location): the key, its value and what would
    work; for an item of a list, the whole list as ``given`` holds it and which item is wrong."""
    lines, seen = [], set()
    for item in error.errors():
        loc = tuple(part for part in item["loc"] if isinstance(part, str))
        loc = loc[
            : next(
                (i for i, p in enumerate(loc) if p in ("int", "float", "str", "none", "bool")),
                len(loc),
            )
        ]
        dotted = ".".join(loc)
        if dotted in seen:
            continue
        seen.add(dotted)
        hint = _field_hint(loc, schema)
        if item["type"] == "extra_forbidden":
            shown = f"`.venv/bin/python {schema.RECIPE} --cfg job`"
            lines.append(f"{dotted} is not a known key: remove it (see {shown})")
        elif item["type"] == "missing":
            lines.append(
                f"{dotted} is missing from the config: add it back with +{dotted}=..., {hint}"
            )
        else:
            wrong = _not_valid(item, loc, given or {})
            use = _section_use(loc, item["input"], schema) or f"use {hint or item['msg']}"
            lines.append(f"{dotted}={wrong}: {use}")
    return lines


def _section_use(loc: tuple, value: Any, schema: type[Config]) -> str | None:
    """What to write where a section of keys (``distill``, ``train``) was given a value: set its
    keys, the first one whose hint shows how, e.g. ``distill.alpha=0.5``; None for any other key
    or a mapping (whose own keys are checked)."""
    info = _field_info(loc, schema)
    section = info.annotation if info is not None else None
    if isinstance(value, dict) or not (
        isinstance(section, type) and issubclass(section, BaseModel)
    ):
        return None
    dotted = ".".join(loc)
    hints = [field.description or "" for field in section.model_fields.values()]
    shown = [found[0].rstrip(",).") for hint in hints if (found := EXAMPLE.findall(hint))]
    example = shown[0] if shown else f"{dotted}.{next(iter(section.model_fields))}=..."
    listed = f"`.venv/bin/python {schema.RECIPE} --cfg job` lists them"
    return f"{dotted} is a section, not a value: set its keys, e.g. {example} ({listed})"


def _not_valid(item: dict, loc: tuple, given: dict) -> str:
    """ "VALUE is not valid" of a validation error ``item`` at key ``loc``, the value as written: a
    wrong item of a list is shown in the list ``given`` holds, and named by its position
    (``[0, 1] is not valid (its item 1 is 0: ...)``), not as if it were the key's whole value."""
    path, shown = item["loc"], f"{show(item['input'])} is not valid"
    if len(path) <= len(loc) or path[: len(loc)] != loc or not isinstance(path[len(loc)], int):
        return shown
    whole: Any = given
    for part in loc:
        whole = whole.get(part) if isinstance(whole, dict) else None
    if not isinstance(whole, list):
        return shown
    why = item["msg"][:1].lower() + item["msg"][1:]
    wrong = f"its item {path[len(loc)] + 1} is {show(item['input'])}: {why}"
    return f"{show(whole)} is not valid ({wrong})"


class SchemaError(ValueError):
    """The config does not fit the schema; the message names every wrong key."""


def _unresolvable(cfg: DictConfig) -> str:
    """Which key's ``${...}`` interpolation fails (OmegaConf.resolve does not say), with the
    reason."""
    pending = list(OmegaConf.to_container(cfg, resolve=False).items())
    while pending:
        key, value = pending.pop(0)
        if isinstance(value, dict):
            pending += [(f"{key}.{child}", item) for child, item in value.items()]
            continue
        try:
            OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException as failure:
            reason = str(failure).splitlines()[0]
            return f"{key}={show(value)} cannot be resolved ({reason}): fix the ${{...}} reference"
    return "the config cannot be resolved: fix its ${...} references"


def _unset(container: Any, prefix: str = "") -> list[str]:
    """Keys left at ``???``."""
    if isinstance(container, dict):
        return [
            key for name, value in container.items() for key in _unset(value, f"{prefix}{name}.")
        ]
    return [prefix[:-1]] if container == "???" else []


def validate(cfg: DictConfig, schema: type[Config] = Config) -> Config:
    """The composed config (without its ``hydra`` node) checked against the ``schema`` (a recipe's:
    ``Config`` or a subclass), every problem at once."""
    body = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        container = OmegaConf.to_container(body, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as error:
        raise SchemaError(_unresolvable(body)) from error
    unset = _unset(container)
    if unset:
        hints = {
            "data.path": "data.path is not set: data=jsonl needs data.path=/path/to/file.jsonl"
        }
        raise SchemaError(
            "; ".join(hints.get(key, f"{key} is not set (???): give it a value") for key in unset)
        )
    try:
        return schema.model_validate(container)
    except ValidationError as error:
        raise SchemaError("; ".join(describe(error, container, schema))) from None
