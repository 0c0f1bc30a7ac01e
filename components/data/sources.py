"""Where the records come from: the generated demo set, a user's JSONL file, or any ``datasets``
source.

Each source is a small frozen dataclass built from its ``conf/data/*.yaml`` group (the group's
``_target_`` names the class, see :func:`build_source`) and offers the same three things:

- ``fingerprint()``: a short string that changes whenever the records would (file names, sizes and
  a SHA-256 of their contents, hashed once per process), so prepared data can be cached under it;
- ``load(cache_dir)``: a ``datasets.Dataset`` with ``prompt``/``response`` or ``messages`` columns
  only;
- ``texts(cache_dir)``: the record strings one by one, lazily, to train a tokenizer on the first of
  them.
"""

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Protocol

import datasets

from components.data import generated, preference
from components.data.hf import load_split, map_columns, map_pair_columns
from components.data.jsonl import DataError, iter_jsonl
from components.data.preference import (
    iter_pair_conversations,
    iter_preference_jsonl,
    iter_preference_records,
)
from components.data.tokenizer import training_texts
from components.targets import TargetError, target_class

MESSAGES = datasets.Features(
    {"messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]}
)
PROMPT_RESPONSE = datasets.Features(
    {"prompt": datasets.Value("string"), "response": datasets.Value("string")}
)


class DataSource(Protocol):
    num_examples: int | None
    val_fraction: float
    # conversations each record becomes: 1, or 2 for a preference pair (chosen, then rejected),
    # which the split and the batches keep together
    examples_per_record: ClassVar[int]

    def fingerprint(self) -> str: ...

    def load(self, cache_dir: Path) -> datasets.Dataset: ...

    def texts(self, cache_dir: Path) -> Iterator[str]: ...


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_stats(path: Path) -> list:
    """(relative name, size, SHA-256 of the content) of a file or of every file under a folder,
    sorted: a file rewritten with the same size and mtime (``cp -p``, ``touch -r``, an editor
    keeping times) has another fingerprint."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [
        (str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, content_digest(p))
        for p in files
    ]


def content_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes (well under a second per 100 MB), hashed once per process for
    each version of the file: a new size, mtime, ctime (which no user can set back) or inode hashes
    it again."""
    stat = path.stat()
    return _hashed(
        str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino
    )


@functools.cache
def _hashed(path: str, *version: int) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _first(dataset: datasets.Dataset, num_examples: int | None) -> datasets.Dataset:
    if num_examples is None or num_examples >= len(dataset):
        return dataset
    return dataset.select(range(num_examples))


def _dataset_texts(dataset: datasets.Dataset) -> Iterator[str]:
    for batch in dataset.iter(batch_size=1000):
        columns = list(batch)
        for index in range(len(batch[columns[0]])):
            yield from training_texts([{column: batch[column][index] for column in columns}])


@dataclass(frozen=True, kw_only=True)
class GeneratedSource:
    """The embedded instruction-following set (:mod:`components.data.generated`), ``num_examples``
    records."""

    num_examples: int
    val_fraction: float
    seed: int
    examples_per_record: ClassVar[int] = 1

    def fingerprint(self) -> str:
        code = hashlib.sha256(Path(generated.__file__).read_bytes()).hexdigest()
        return _digest("generated", self.num_examples, self.seed, code)

    def load(self, cache_dir: Path) -> datasets.Dataset:
        return datasets.Dataset.from_generator(
            generated.iter_examples,
            features=PROMPT_RESPONSE,
            gen_kwargs={"n": self.num_examples, "seed": self.seed},
            cache_dir=str(cache_dir),
            fingerprint=self.fingerprint(),
        )

    def texts(self, cache_dir: Path) -> Iterator[str]:
        for record in generated.iter_examples(self.num_examples, self.seed):
            yield from training_texts([record])


def _normalized_jsonl(path: str) -> Iterator[dict]:
    """Every record of the file as ``{"messages": [{"role", "content"}, ...]}`` (one schema for both
    shapes)."""
    for record in iter_jsonl(path):
        if "messages" in record:
            yield {
                "messages": [
                    {"role": m["role"], "content": m["content"]} for m in record["messages"]
                ]
            }
        else:
            yield {
                "messages": [
                    {"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["response"]},
                ]
            }


def _conversations(
    generator, arguments: dict, cache_dir: Path, source, expected: str = ""
) -> datasets.Dataset:
    """The ``{"messages"}`` records ``generator(**arguments)`` yields, as a dataset in
    ``cache_dir`` under ``source``'s fingerprint; a DataError the generator raises, one line
    (``expected``: what a source of no records should hold).

    Raises:
        DataError: The generator's, or one line for a source of no records or one that cannot be
            read.
    """
    empty = DataError(f"{source.path} has no records{expected}")
    try:
        dataset = datasets.Dataset.from_generator(
            generator,
            features=MESSAGES,
            gen_kwargs=arguments,
            cache_dir=str(cache_dir),
            fingerprint=source.fingerprint(),
        )
    except datasets.exceptions.DatasetGenerationError as error:
        if isinstance(error.__cause__, DataError):
            raise error.__cause__ from None
        if isinstance(error.__cause__, datasets.arrow_writer.SchemaInferenceError):
            raise empty from None  # datasets cannot build a split of no records
        raise DataError(f"{source.path} cannot be read: {str(error).splitlines()[0]}") from None
    except ValueError as error:  # an empty file: 'Instruction "train" corresponds to no data!'
        raise empty from error
    if len(dataset) == 0:
        raise empty
    return dataset


@dataclass(frozen=True, kw_only=True)
class JsonlSource:
    """A JSONL file of ``{"prompt", "response"}`` or ``{"messages"}`` records, each line checked as
    read (errors name the line: ``data.jsonl line 3: not valid JSON (...)``); the first
    ``num_examples`` or all."""

    path: str
    num_examples: int | None
    val_fraction: float
    examples_per_record: ClassVar[int] = 1
    kind: ClassVar[str] = "jsonl"

    @staticmethod
    def conversations(path: str) -> Iterator[dict]:
        """The file's records as ``{"messages"}`` conversations, in order."""
        return _normalized_jsonl(path)

    def fingerprint(self) -> str:
        path = Path(self.path).expanduser().resolve()
        if path.is_dir():
            raise DataError(
                f"data.path={self.path} is a folder, and data=jsonl reads one JSONL file: give the "
                "file, or data=hf for a folder of json, jsonl, parquet, csv or arrow files"
            )
        if not path.is_file():
            raise DataError(f"data file not found: {self.path}")
        return _digest(self.kind, str(path), _file_stats(path), self.num_examples)

    def load(self, cache_dir: Path) -> datasets.Dataset:
        """The records as a dataset in ``cache_dir`` (the file is read once; later calls reuse the
        Arrow copy)."""
        path = str(Path(self.path).expanduser().resolve())
        arguments, expected = {"path": path}, ": expected one JSON object per line"
        dataset = _conversations(self.conversations, arguments, cache_dir, self, expected)
        count = None if self.num_examples is None else self.num_examples * self.examples_per_record
        return _first(dataset, count)

    def texts(self, cache_dir: Path) -> Iterator[str]:
        yield from _dataset_texts(self.load(cache_dir))


@dataclass(frozen=True, kw_only=True)
class PreferenceJsonlSource(JsonlSource):
    """A JSONL file of preference records (:mod:`components.data.preference`), each two
    conversations, chosen then rejected; ``num_examples``: the first records (pairs), or all."""

    examples_per_record: ClassVar[int] = 2
    kind: ClassVar[str] = "preference-jsonl"

    @staticmethod
    def conversations(path: str) -> Iterator[dict]:
        return iter_preference_jsonl(path)


@dataclass(frozen=True, kw_only=True)
class EmbeddedPreferenceSource:
    """The embedded preference set (:func:`components.data.preference.iter_pairs`):
    ``num_examples`` pairs, each two conversations, chosen then rejected."""

    num_examples: int
    val_fraction: float
    seed: int
    examples_per_record: ClassVar[int] = 2

    def fingerprint(self) -> str:
        code = [
            hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()
            for module in (generated, preference)
        ]
        return _digest("preference", self.num_examples, self.seed, code)

    def load(self, cache_dir: Path) -> datasets.Dataset:
        return datasets.Dataset.from_generator(
            iter_pair_conversations,
            features=MESSAGES,
            gen_kwargs={"n": self.num_examples, "seed": self.seed},
            cache_dir=str(cache_dir),
            fingerprint=self.fingerprint(),
        )

    def texts(self, cache_dir: Path) -> Iterator[str]:
        yield from training_texts(iter_pair_conversations(self.num_examples, self.seed))


@dataclass(frozen=True, kw_only=True)
class HFSource:
    """Any split ``datasets`` can load (:func:`components.data.hf.load_split`), its ``columns``
    mapped onto ``prompt``/``response`` or ``messages`` (``{"prompt": "instruction", "response":
    "output"}``; empty: the source's own columns of those names)."""

    path: str
    split: str
    name: str | None
    columns: dict[str, str] | None = field(hash=False)
    num_examples: int | None
    val_fraction: float
    examples_per_record: ClassVar[int] = 1
    kind: ClassVar[str] = "hf"

    def _dataset(self, cache_dir: Path) -> datasets.Dataset:
        dataset = load_split(self.path, self.split, self.name, cache_dir)
        return _first(map_columns(dataset, dict(self.columns or {}), self.path), self.num_examples)

    def fingerprint(self) -> str:
        local = Path(self.path).expanduser()
        if local.exists():
            origin = [str(local.resolve()), _file_stats(local.resolve())]
        else:  # a Hub dataset: the files datasets cached for it name its version
            files = load_split(self.path, self.split, self.name, Path.cwd()).cache_files
            origin = [
                self.path,
                [(Path(f["filename"]).name, Path(f["filename"]).stat().st_size) for f in files],
            ]
        return _digest(
            self.kind,
            origin,
            self.split,
            self.name,
            sorted((self.columns or {}).items()),
            self.num_examples,
        )

    def load(self, cache_dir: Path) -> datasets.Dataset:
        return self._dataset(cache_dir)

    def texts(self, cache_dir: Path) -> Iterator[str]:
        yield from _dataset_texts(self._dataset(cache_dir))


@dataclass(frozen=True, kw_only=True)
class PreferenceHFSource(HFSource):
    """Any split ``datasets`` can load of preference records (:mod:`components.data.preference`,
    the forms and checks of a JSONL file's; a column missing in a record, which ``datasets`` reads
    as None, is absent), its ``columns`` mapped onto ``prompt`` (optional), ``chosen`` and
    ``rejected``; each record two conversations, chosen then rejected; ``num_examples``: the
    first records (pairs), or all."""

    examples_per_record: ClassVar[int] = 2
    kind: ClassVar[str] = "preference-hf"

    def load(self, cache_dir: Path) -> datasets.Dataset:
        columns = tuple(sorted((self.columns or {}).items()))
        arguments = dict(source=self.path, split=self.split, name=self.name, columns=columns)
        arguments |= dict(num_examples=self.num_examples, cache_dir=str(cache_dir))
        return _conversations(_hf_pair_conversations, arguments, cache_dir, self)

    def texts(self, cache_dir: Path) -> Iterator[str]:
        yield from _dataset_texts(self.load(cache_dir))


def _hf_pair_conversations(
    source: str, split: str, name: str | None, columns: tuple, num_examples, cache_dir: str
) -> Iterator[dict]:
    """The first ``num_examples`` (or all) preference records of a ``datasets`` split, each
    checked and made two ``{"messages"}`` conversations, chosen then rejected."""
    dataset = load_split(source, split, name, Path(cache_dir))
    records = _first(map_pair_columns(dataset, dict(columns), source), num_examples)
    yield from iter_preference_records(records, source)


@dataclass(frozen=True, kw_only=True)
class MixPart:
    """One source of a mixture: its name (``val_loss/<name>``), weight and records."""

    name: str
    weight: float
    source: DataSource


@dataclass(frozen=True, kw_only=True)
class MixSource:
    """Several sources read as one training stream, each in the share of its weight
    (:mod:`components.data.mixture`), each with its own validation split. ``val_fraction`` and
    ``num_examples`` are the defaults its sources were built with (``conf/data/mix.yaml``)."""

    parts: tuple[MixPart, ...]
    num_examples: int | None
    val_fraction: float

    def fingerprint(self) -> str:
        return _digest("mix", [(p.name, p.weight, p.source.fingerprint()) for p in self.parts])

    def texts(self, cache_dir: Path) -> Iterator[str]:
        """The sources' texts taken in turn, one from each, so a capped tokenizer training sees
        every source."""
        readers, end = [part.source.texts(cache_dir) for part in self.parts], object()
        while readers:
            for reader in list(readers):
                text = next(reader, end)
                if text is end:
                    readers.remove(reader)
                else:
                    yield text


SOURCES = {
    f"{cls.__module__}.{cls.__name__}": cls
    for cls in (GeneratedSource, JsonlSource, HFSource, EmbeddedPreferenceSource)
}


def preference_source(source: DataSource) -> DataSource:
    """``source`` read as preference pairs (DPO's data): the embedded pairs as they are, a JSONL
    file's or a ``datasets`` split's records as preference records.

    Raises:
        DataError: One line, for a source whose records are not read as pairs.
    """
    if isinstance(source, EmbeddedPreferenceSource | PreferenceJsonlSource | PreferenceHFSource):
        return source
    if type(source) is JsonlSource:
        return PreferenceJsonlSource(
            path=source.path, num_examples=source.num_examples, val_fraction=source.val_fraction
        )
    if type(source) is HFSource:
        return PreferenceHFSource(
            **{field.name: getattr(source, field.name) for field in fields(source)}
        )
    name = {GeneratedSource: "default"}.get(type(source), type(source).__name__)
    raise DataError(
        f"data={name} is not read as preference pairs: use data=preference (the embedded pairs), "
        'data=jsonl data.path=F or data=hf data.path=F ({"prompt", "chosen", "rejected"} records)'
    )


def build_source(group: dict) -> DataSource:
    """The source a ``conf/data/*.yaml`` group describes: its ``_target_`` names one of
    :data:`SOURCES` and every other key is a field of that class.

    Raises:
        DataError: One line, if ``_target_`` is not a known source or a field is missing or unknown.
    """
    fields_ = dict(group)
    target = fields_.pop("_target_", None)
    try:  # only a class of SOURCES: nothing else a config names is imported
        cls = target_class("data", target, registry=SOURCES, kind="a data source")
    except TargetError as error:
        raise DataError(str(error)) from None
    names = {f.name for f in fields(cls)}
    unknown, missing = sorted(set(fields_) - names), sorted(names - set(fields_))
    if unknown or missing:
        what = [f"data.{key} is not a key of {cls.__name__}" for key in unknown]
        what += [f"data.{key} is missing (a field of {cls.__name__})" for key in missing]
        raise DataError("; ".join(what))
    return cls(**fields_)
