"""One way to turn a config group's ``_target_`` (a dotted class path) into the class it builds.

Hydra owns the lookup (``hydra.utils.get_class``); this module adds what every group needs: the
class is one the group can build (a subclass of its base, or one of a fixed registry, and then
nothing outside the registry is imported), and the group's other keys are options of the class.
Every refusal is one line naming the key and what to change.
"""

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from hydra.utils import get_class

_HYDRA_UTILS_LOG = logging.getLogger("hydra.utils")


class TargetError(ValueError):
    """A ``_target_`` that names no class the group can build; the message is the line to show."""


def target_class(
    group: str,
    target: str | None,
    *,
    base: type = object,
    registry: Mapping[str, type] | None = None,
    kind: str | None = None,
) -> type:
    """The class ``<group>._target_`` names: one of ``registry`` when given, else any importable
    subclass of ``base``. ``kind`` says what the group builds, for the error ("a data source").

    Raises:
        TargetError: e.g. ``optim._target_='torch.optim.Adamm' is not a class the optim group can
            build: pick one with optim=NAME``; with a registry, ``... : use one of A, B``.
    """
    kind = kind or f"a class the {group} group can build"
    if registry is not None:
        if target not in registry:
            known = ", ".join(sorted(registry))
            raise TargetError(f"{group}._target_={target!r} is not {kind}: use one of {known}")
        return registry[target]
    found = _located_class(target) if target else None
    if found is None or not issubclass(found, base):
        raise TargetError(f"{group}._target_={target!r} is not {kind}: pick one with {group}=NAME")
    return found


def _located_class(target: str) -> type | None:
    """``get_class(target)``, or None where it names no importable class. Hydra logs each failure
    as an error, which would print beside our one ``error:`` line: its log is muted meanwhile."""
    muted, _HYDRA_UTILS_LOG.disabled = _HYDRA_UTILS_LOG.disabled, True
    try:
        return get_class(target)
    except (ImportError, ValueError):
        return None
    finally:
        _HYDRA_UTILS_LOG.disabled = muted


def check_target(
    group: str,
    target: str,
    options: Mapping[str, Any],
    base: type,
    fixed: set[str],
) -> list[str]:
    """Why ``<group>`` cannot be built: its ``_target_`` names no subclass of ``base``, or a key is
    not an option of the class (its constructor's parameters less ``fixed``, which the recipe
    passes itself). Empty when it can."""
    try:
        cls = target_class(group, target, base=base)
    except TargetError as error:
        return [str(error)]
    accepted = set(inspect.signature(cls).parameters) - fixed
    listed = ", ".join(sorted(accepted))
    unknown = sorted(set(options) - accepted)
    return [f"{group}.{key} is not an option of {target}; its options: {listed}" for key in unknown]
