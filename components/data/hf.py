"""Load a dataset split with the ``datasets`` library and map its columns onto prompt/response or
messages.

``data.path`` may be a local file (json, jsonl, parquet, csv, arrow), a folder of such files, a
folder written by ``save_to_disk``, or a Hub dataset id. Every failure becomes a :class:`DataError`
with one line naming the path and what would work, never a traceback from inside ``datasets``.
"""

import contextlib
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow.parquet
from datasets.exceptions import DatasetGenerationError

from components.data.jsonl import DataError

# File suffix -> the ``datasets`` builder that reads it.
BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# What a source's columns may be mapped onto: one of these sets, exactly.
TARGETS = ({"prompt", "response"}, {"messages"})
# What a preference source's columns may be mapped onto (recipes/dpo.py's data=hf).
PAIR_TARGETS = ({"prompt", "chosen", "rejected"}, {"chosen", "rejected"})
# A source's own columns when its records are of both kinds (kept as they are, no mapping given)
OWN_BOTH = {"prompt", "response", "messages"}


def _first_line(error: BaseException) -> str:
    """The first line of ``error``, or of its cause where ``datasets`` wrapped one ("An error
    occurred while generating the dataset": the JSON parse error behind it)."""
    if isinstance(error, DatasetGenerationError) and error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def datasets_quiet() -> Iterator[None]:
    """``datasets``' own log lines off while it reads (its "Failed to load JSON ..." before the
    error it raises, which becomes the one line of :class:`DataError`)."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _saved_folder(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _from_disk(path: Path, split: str) -> datasets.Dataset:
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(
                f"data.split={split!r} is not a split of {path}: it has {', '.join(sorted(saved))}"
            )
        return saved[split]
    if split not in ("train", str(saved.split)):
        raise DataError(
            f"data.split={split!r} is not a split of {path}: it holds one split, use "
            "data.split=train"
        )
    return saved


def _load_local(path: Path, split: str, cache_dir: Path) -> datasets.Dataset:
    if path.is_dir():
        if _saved_folder(path):
            return _from_disk(path, split)
        return datasets.load_dataset(str(path), split=split, cache_dir=str(cache_dir))
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"data.path={str(path)!r} has suffix {path.suffix!r}: use a "
            f"{', '.join(sorted(BUILDERS))} file, "
            "a folder of them, or a save_to_disk folder"
        )
    refuse_an_empty_file(path, str(path))
    # A single file is the "train" split of its builder; any other split name does not exist in it.
    return datasets.load_dataset(
        builder, data_files={"train": str(path)}, split=split, cache_dir=str(cache_dir)
    )


def refuse_an_empty_file(path: Path, shown: str) -> None:
    """One line for a local file of no records, which ``datasets`` would fail on with its own
    words (a parquet file of no rows: pyarrow's "BatchSize must be greater than 0"; a blank JSON
    Lines file: "StopIteration"): parquet's row count from its footer, JSON's and CSV's text.

    Raises:
        DataError: ``data.path='...' has no records``.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        empty = pyarrow.parquet.read_metadata(path).num_rows == 0
    elif suffix in (".json", ".jsonl", ".csv"):
        with path.open("rb") as file:
            lines = [line for line in itertools.islice(file, 2) if line.strip()]
        empty = not lines or (suffix == ".csv" and len(lines) < 2)  # a csv's header alone
    else:
        return
    if empty:
        raise DataError(f"data.path={shown!r} has no records")


def _load(
    local: Path, path: str, split: str, name: str | None, cache_dir: Path
) -> datasets.Dataset:
    """:func:`load_split`'s read: a local file or folder, else a Hub id."""
    if local.exists():
        return _load_local(local, split, cache_dir)
    if not _looks_like_hub_id(path):
        raise DataError(
            f"data.path={path!r} does not exist: give a data file or folder, or a Hub dataset id"
        )
    return datasets.load_dataset(path, name, split=split)


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not path.startswith((".", "~"))


def load_split(path: str, split: str, name: str | None, cache_dir: Path) -> datasets.Dataset:
    """The ``split`` of the dataset at ``path`` (local file or folder, or a Hub id with config
    ``name``).

    Local files are converted to Arrow under ``cache_dir``; Hub datasets use the Hugging Face cache.

    Raises:
        DataError: One line, if the path does not exist, the split does not, the Hub cannot be
            reached and nothing is cached, or ``datasets`` cannot read the files.
    """
    local = Path(path).expanduser()
    try:
        with datasets_quiet():
            return _load(local, path, split, name, cache_dir)
    except DataError:
        raise
    except ConnectionError as error:
        raise DataError(
            f"data.path={path!r} is not a local file or folder and the Hub cannot be reached "
            f"({_first_line(error)}); download it once with a network, or give a local path"
        ) from None
    except ValueError as error:
        if "split" in str(error).lower():
            raise DataError(
                f"data.split={split!r} is not a split of {path}: {_first_line(error)}"
            ) from None
        raise DataError(f"data.path={path!r} cannot be read: {_first_line(error)}") from None
    except (
        Exception
    ) as error:  # datasets raises many kinds (FileNotFoundError, DatasetGenerationError, ...)
        raise DataError(f"data.path={path!r} cannot be read: {_first_line(error)}") from None


def map_columns(
    dataset: datasets.Dataset | datasets.IterableDataset, columns: dict[str, str] | None, path: str
) -> datasets.Dataset | datasets.IterableDataset:
    """Rename the source's columns onto ``prompt``/``response`` or ``messages`` and drop every other
    column.

    ``columns`` maps our name to the source's (``{"prompt": "instruction", "response": "output"}``);
    None or empty takes the source's own ``prompt``/``response`` or ``messages`` columns (all three
    where it has them: records of both kinds, each with the other's as None).

    Raises:
        DataError: If the mapping targets anything else, or names a column the source does not have.
    """
    # a stream of JSON records knows its columns once the first is read
    have = list(dataset.column_names or next(iter(dataset), {}))
    # a file of both kinds of record: each row has the other kind's columns as None
    both = not columns and OWN_BOTH <= set(have)
    if both:
        columns = {name: name for name in sorted(OWN_BOTH)}
    elif not columns:
        columns = (
            {"messages": "messages"}
            if "messages" in have
            else {"prompt": "prompt", "response": "response"}
        )
    targets = (*TARGETS, OWN_BOTH) if both else TARGETS
    return _mapped(dataset, columns, have, path, targets, "prompt and response, or messages")


def map_pair_columns(dataset: datasets.Dataset, columns: dict[str, str] | None, path: str):
    """Rename the source's columns onto a preference record's ``prompt`` (optional), ``chosen``
    and ``rejected`` and drop every other column; None or empty takes the source's own columns
    of those names (``prompt`` when it has one).

    Raises:
        DataError: If the mapping targets anything else, or names a column the source does not have.
    """
    have = list(dataset.column_names)
    if not columns:
        own = ("prompt", "chosen", "rejected") if "prompt" in have else ("chosen", "rejected")
        columns = {name: name for name in own}
    return _mapped(dataset, columns, have, path, PAIR_TARGETS, "chosen and rejected (and prompt)")


def _mapped(dataset, columns: dict[str, str], have: list, path: str, targets, said: str):
    """``dataset`` with only the columns ``columns`` maps ours onto (one of ``targets``, ``said``
    in words), renamed ours; a column of numbers (a csv's) read as strings."""
    if set(columns) not in targets:
        raise DataError(
            f"data.columns maps {', '.join(sorted(columns))}: map exactly {said}, onto columns of "
            f"{path} ({', '.join(have)})"
        )
    missing = [
        f"{ours}={theirs!r}" for ours, theirs in sorted(columns.items()) if theirs not in have
    ]
    if missing:
        raise DataError(
            f"data.columns {', '.join(missing)}: no such column in {path}; its columns are "
            f"{', '.join(have)}"
        )
    dataset = dataset.select_columns(list(columns.values()))
    renames = {theirs: ours for ours, theirs in columns.items() if theirs != ours}
    dataset = dataset.rename_columns(renames) if renames else dataset
    for column in columns:  # a csv answer column of numbers is read as integers
        feature = (dataset.features or {}).get(column)
        if isinstance(feature, datasets.Value) and feature.dtype not in ("string", "large_string"):
            dataset = dataset.cast_column(column, datasets.Value("string"))
    return dataset
