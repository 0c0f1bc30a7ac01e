"""The data group's checks, before anything is read or tokenized: a ``path`` that is a device, a
pipe or missing is refused; the group becomes its source (its ``_target_`` picks the kind), a local
``path`` made absolute."""

import math
import stat
from dataclasses import replace
from pathlib import Path

from components.data.jsonl import DataError
from components.data.sources import (
    DataSource,
    HFSource,
    MixPart,
    MixSource,
    build_source,
    preference_source,
)
from components.data.streaming import StreamedSource
from components.problems import Problem, show

# Keys of the data group that say how records are read and labelled, not where they come from: the
# schema's (recipes/schema.py), read by the preparation, no field of a source.
LABELLING_KEYS = ("loss_on", "streaming")


MIX_TARGET = f"{MixSource.__module__}.{MixSource.__name__}"
# The keys of a mixture's source that are the mixture's, not its kind's.
MIX_KEYS = ("name", "weight", "kind")


def checked_source(
    group: dict, pairs: bool, kinds: dict[str, dict]
) -> tuple[DataSource | MixSource | None, list[Problem]]:
    """The ``data`` group (its keys as given, ``_target_`` included) as a source, or why not;
    ``pairs``: read as preference pairs (DPO's), else as prompt and answer records. ``kinds``: the
    groups a mixture's sources may be, by kind, with their keys' defaults."""
    streaming = group.get("streaming", False)
    group = {key: value for key, value in group.items() if key not in LABELLING_KEYS}
    if streaming:
        return _streamed(group, pairs, kinds)
    if group.get("_target_") == MIX_TARGET and pairs:
        refused = "data=mix mixes prompt and answer records: preference pairs are not mixed yet"
        return None, [Problem(key="data", message=refused)]
    if group.get("_target_") == MIX_TARGET:
        return checked_mixture(group, kinds)
    return _checked_single(group, pairs)


def _streamed(
    group: dict, pairs: bool, kinds: dict[str, dict]
) -> tuple[StreamedSource | MixSource | None, list[Problem]]:
    """``data.streaming=true``: the ``data=hf`` source of ``group`` read as a stream (a mixture's
    ``hf`` sources, each a stream), or one line saying what is not streamed."""
    if pairs:  # from any source: the one fix is not to stream
        read = "preference pairs are tokenized into the cache before training, never streamed"
        message = f"data.streaming=true: {read}: use data.streaming=false"
        return None, [Problem(key="data.streaming", message=message)]
    if group.get("_target_") == MIX_TARGET:
        return _streamed_mixture(group, kinds)
    if group.get("_target_") != f"{HFSource.__module__}.{HFSource.__name__}":
        refused = "only a datasets source is streamed, not data=jsonl's file or data=default's set"
        fix = "use data=hf data.path=FILE_FOLDER_OR_HUB_ID, or data.streaming=false"
        message = f"data.streaming=true: {refused}: {fix}"
        return None, [Problem(key="data.streaming", message=message)]
    source, found = _checked_single(group, pairs=False)
    if source is None:
        return None, found
    return _as_stream(source), []


def _as_stream(source: HFSource) -> StreamedSource:
    where = dict(path=source.path, split=source.split, name=source.name)
    columns = tuple(sorted((source.columns or {}).items()))
    return StreamedSource(**where, columns=columns, num_examples=source.num_examples)


def _streamed_mixture(
    group: dict, kinds: dict[str, dict]
) -> tuple[MixSource | None, list[Problem]]:
    """``data=mix data.streaming=true``: the mixture with each source a stream, or a line for
    each source that is not a ``datasets`` source (kind ``hf``) or holds its own rows out."""
    mix, found = checked_mixture(group, kinds)
    if mix is None:
        return None, found
    parts = []
    for index, (entry, part) in enumerate(zip(group["sources"], mix.parts, strict=True)):
        where = f"data.sources[{index}] ({part.name})"
        if not isinstance(part.source, HFSource):
            fix = "give kind:hf,path:FILE_FOLDER_OR_HUB_ID, or data.streaming=false"
            found.append(_mix_problem(f"{where}: kind {entry['kind']} is not streamed: {fix}"))
        elif entry.get("val_fraction"):  # the mixture's own: the schema's line (recipes/)
            held = f"val_fraction={show(part.source.val_fraction)}: a stream holds nothing out"
            found.append(_mix_problem(f"{where}: {held}: set it to 0 or leave it out"))
        else:
            parts.append(replace(part, source=_as_stream(part.source)))
    return (None, found) if found else (replace(mix, parts=tuple(parts)), [])


def checked_mixture(group: dict, kinds: dict[str, dict]) -> tuple[MixSource | None, list[Problem]]:
    """``data=mix``: every source of ``data.sources`` built as its kind's group with the keys it
    gives (``num_examples`` and ``val_fraction`` the mixture's unless it gives its own), its weight
    checked; every problem a line of its own."""
    sources, found = group.get("sources"), []
    for key in sorted(set(group) - {"_target_", "sources", "num_examples", "val_fraction"}):
        found.append(_mix_problem(f"data.{key} is not a key of data=mix"))
    if not isinstance(sources, list) or not sources:
        return None, [*found, _mix_problem(f"data.sources={show(sources)} {NOT_A_LIST}")]
    parts = [_mix_part(index, entry, group, kinds, found) for index, entry in enumerate(sources)]
    names = [part.name for part in parts if part is not None]
    for name in sorted({name for name in names if names.count(name) > 1}):
        times = names.count(name)
        found.append(_mix_problem(f"data.sources: {name!r} names {times} sources: name each once"))
    if all(part is not None and not part.weight for part in parts):
        found.append(_mix_problem("data.sources: every weight is 0: give one a positive weight"))
    if found:
        return None, found
    mix = dict(num_examples=group["num_examples"], val_fraction=group["val_fraction"])
    return MixSource(parts=tuple(parts), **mix), []


NOT_A_LIST = (
    "is not a list of sources: use e.g. data.sources='[{name:mine,weight:0.7,kind:jsonl,"
    "path:my.jsonl},{name:demo,weight:0.3,kind:generated}]'"
)


def _mix_problem(message: str) -> Problem:
    return Problem(key="data.sources", message=message)


def _mix_part(
    index: int, entry, group: dict, kinds: dict[str, dict], found: list[Problem]
) -> MixPart | None:
    """Source ``index`` of ``data.sources`` as a part of the mixture, or None with its problems
    appended to ``found``."""
    where = f"data.sources[{index}]"
    if not isinstance(entry, dict):
        found.append(_mix_problem(f"{where}={show(entry)} is not a {{name, weight, kind, ...}}"))
        return None
    name, weight, kind = (entry.get(key) for key in MIX_KEYS)
    problems = []
    if not isinstance(name, str) or not name.strip() or "/" in name:
        problems.append(f"{where}.name={show(name)}: give a name without '/' (val_loss/<name>)")
    if not _is_weight(weight):
        problems.append(f"{where}.weight={show(weight)}: give a number >= 0 (a share of the rows)")
    if kind not in kinds:
        problems.append(f"{where}.kind={show(kind)}: use one of {', '.join(kinds)}")
    for key in sorted(set(entry) & set(LABELLING_KEYS)):
        problems.append(f"{where}.{key}: the mixture's key, for every source: set data.{key}")
    if problems:
        found += [_mix_problem(message) for message in problems]
        return None
    keys = {key: value for key, value in entry.items() if key not in MIX_KEYS}
    shared = ("num_examples", "val_fraction")
    defaults = {key: group[key] for key in shared if group[key] is not None}
    own = {key: value for key, value in kinds[kind].items() if key not in LABELLING_KEYS}
    merged = {**own, **defaults, **keys}
    if missing := [key for key, value in merged.items() if value == "???"]:
        needs = f"{where} ({name}): kind {kind} needs {', '.join(missing)}"
        found.append(_mix_problem(f"{needs}, e.g. {{name:{name},kind:{kind},{missing[0]}:...}}"))
        return None
    source, source_problems = _checked_single(merged, pairs=False)
    found += [_mix_problem(f"{where} ({name}): {problem.message}") for problem in source_problems]
    return None if source is None else MixPart(name=name, weight=float(weight), source=source)


def _is_weight(weight) -> bool:
    number = isinstance(weight, int | float) and not isinstance(weight, bool)
    return number and math.isfinite(weight) and weight >= 0


def _checked_single(group: dict, pairs: bool) -> tuple[DataSource | None, list[Problem]]:
    """One source's group as a source (of preference ``pairs``, or of prompts and answers), or
    why not."""
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
