"""Names for new folders beside taken ones: ``path``, else ``path_2``, ``path_3``, ... Below every
layer: a per-run output folder (components/runtime) and an abandoned checkpoint
(components/checkpoint) are both named this way."""

from pathlib import Path


def unused_name(path: Path) -> Path:
    """``path``, or ``path_2``, ``path_3``, ... the first that does not exist."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}_{number}")
    return candidate
