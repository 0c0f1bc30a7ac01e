"""What a check returns: a :class:`Problem` names the key that cannot work and says why, in one
line. Every owner (the layout, the models, the data, the schema's sections) returns problems; the
recipe's pre-flight prints them all at once (``components/runtime/problems.py``)."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Problem:
    key: str  # the setting that cannot work: a config key, or the area (``model``, ``data``)
    message: str  # the whole sentence: the key, its value and what would work


def problems(key: str, messages: Iterable[str]) -> list[Problem]:
    """A component's messages about ``key`` as problems."""
    return [Problem(key=key, message=message) for message in messages]


def show(value: Any) -> str:
    """A value as a Hydra override would spell it (null, true, 'text', [1, 2])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)
