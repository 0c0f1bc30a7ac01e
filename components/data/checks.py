"""The data group's checks, before anything is read or tokenized: a ``path`` that is a device, a
pipe or missing is refused; the group becomes its source (its ``_target_`` picks the kind), a local
``path`` made absolute."""

import stat
from pathlib import Path

from components.data.jsonl import DataError
from components.data.sources import DataSource, build_source, preference_source
from components.problems import Problem, show


def checked_source(group: dict, pairs: bool = False) -> tuple[DataSource | None, list[Problem]]:
    """The ``data`` group (its keys as given, ``_target_`` included) as a source, or why not;
    ``pairs``: read as preference pairs (DPO's), else as prompt and answer records."""
    group = dict(group)
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
        source = build_source(group)
        return (preference_source(source) if pairs else _answers(source)), []
    except DataError as error:
        return None, [Problem(key="data", message=str(error))]


def _answers(source: DataSource) -> DataSource:
    """``source``, when its records are a prompt and an answer (not preference pairs)."""
    if source.examples_per_record > 1:
        raise DataError(
            "data=preference holds preference pairs, which recipes/dpo.py trains on: this recipe "
            "trains on prompt and answer records (data=default, data=jsonl or data=hf)"
        )
    return source


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
