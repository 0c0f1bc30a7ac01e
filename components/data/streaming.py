"""Streaming (``data.streaming=true``): a ``datasets`` source read as an iterable, tokenized and
packed on the fly in a worker process: no tokenized cache, no pass over the set before step 1.

Each dp rank reads its own part of the stream (``split_dataset_by_node``: whole shards when dp
divides their number, else every dp-th record), in the source's order, unshuffled. Its records
become examples as the cached path's do (``tokenize_batch``) and rows as its packing makes them
(next fit; an epoch's last row is closed at the epoch's end), so an epoch of one rank's rows is the
cached path's rows of those records, in order. A step takes each rank's next
``global_batch_size / dp`` rows. The position after a step (the stream's ``state_dict``, the
example carried into the next row, the epoch) comes from the worker with the step's batches and is
saved in the checkpoint, one per dp rank: a resume at the same dp continues exactly there.

Docs: docs/data.md
"""

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from transformers import AutoTokenizer

from components.data.collate import Labelling, record_error, tokenize_batch
from components.data.hf import BUILDERS, map_columns, refuse_an_empty_file
from components.data.jsonl import DataError, record_problem
from components.data.loader import (
    Batch,
    MixedSplit,
    StepBatches,
    TokenizedSplit,
    batch_width,
    collate_rows,
    open_source_vals,
    open_splits,
)
from components.data.tokenizer import training_texts
from components.processes import die_with_parent

# (input_ids, labels, labelled tokens) of one tokenized record
Example = tuple[list[int], list[int], int]


@dataclass(frozen=True, kw_only=True)
class StreamedSource:
    """A ``data=hf`` source read as a stream: ``path`` (a local file or folder, or a Hub id), its
    ``split``, config ``name``, ``columns`` mapping and first ``num_examples`` records. Nothing is
    held out: the size of a stream is not known before it is read."""

    path: str
    split: str
    name: str | None
    columns: tuple[tuple[str, str], ...]
    num_examples: int | None
    val_fraction: ClassVar[float] = 0.0
    examples_per_record: ClassVar[int] = 1

    def fingerprint(self) -> str:
        """The source's names, files' sizes and modification times: not a hash of the contents,
        which would be a pass over the whole set."""
        local = Path(self.path).expanduser()
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        parts = ["stream", self.path, self.split, self.name, self.columns, self.num_examples, stats]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def texts(self, cache_dir: Path) -> Iterator[str]:
        """The records' strings in order, lazily (a tokenizer trained on them reads the first); a
        malformed record is passed over here, and named when the stream reaches it."""
        for record in self.open(dp_size=1, dp_rank=0):
            if record_problem(record) is None:
                yield from training_texts([record])

    def open(self, *, dp_size: int, dp_rank: int) -> datasets.IterableDataset:
        """dp rank ``dp_rank``'s part of the records, as ``prompt``/``response`` or ``messages``.

        Raises:
            DataError: One line, for a path, split or column mapping that cannot be read.
        """
        try:
            stream = map_columns(_stream_of(self), dict(self.columns), self.path)
        except DataError:
            raise
        except StopIteration:  # an empty file's columns, read from its first record
            raise DataError(f"data.path={self.path!r} has no records to stream") from None
        except Exception as error:  # datasets raises many kinds: one line naming the path
            why = _first_line(error)
            raise DataError(f"data.path={self.path!r} cannot be streamed: {why}") from None
        if self.num_examples is not None:
            stream = stream.take(self.num_examples)
        return split_dataset_by_node(stream, rank=dp_rank, world_size=dp_size)


def _stream_of(source: StreamedSource) -> datasets.IterableDataset:
    """The split as ``datasets`` streams it: a file by its suffix's builder, a folder of files, a
    ``save_to_disk`` folder, or a Hub id."""
    local = Path(source.path).expanduser()
    if local.is_file():
        builder = BUILDERS.get(local.suffix.lower())
        if builder is None:
            kinds = ", ".join(sorted(BUILDERS))
            raise DataError(f"data.path={source.path!r} has suffix {local.suffix!r}: use {kinds}")
        refuse_an_empty_file(local, source.path)
        files = {"train": str(local)}
        return datasets.load_dataset(builder, data_files=files, split=source.split, streaming=True)
    if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(local))
        chosen = saved[source.split] if isinstance(saved, datasets.DatasetDict) else saved
        return chosen.to_iterable_dataset()
    where = str(local) if local.is_dir() else source.path
    return datasets.load_dataset(where, source.name, split=source.split, streaming=True)


@dataclass(frozen=True, kw_only=True)
class StreamPosition:
    """Where one dp rank's stream stands between two rows: its ``epoch``, the ``stream``'s
    ``state_dict`` after the last record read (None: the epoch's start), the examples read but not
    yet in a row (``carry``: the next row's first) and the ``records`` read in all (names a bad
    one)."""

    epoch: int = 0
    stream: dict | None = None
    carry: tuple[Example, ...] = ()
    records: int = 0

    def as_json(self) -> dict:
        carry = [list(example) for example in self.carry]
        return {"epoch": self.epoch, "stream": self.stream, "records": self.records, "carry": carry}

    @classmethod
    def of_json(cls, saved: dict) -> "StreamPosition":
        carry = tuple((list(ids), list(labels), int(n)) for ids, labels, n in saved["carry"])
        epoch, stream, records = saved["epoch"], saved["stream"], saved["records"]
        return cls(epoch=epoch, stream=stream, carry=carry, records=records)


@dataclass(frozen=True, kw_only=True)
class RowMaking:
    """How a stream's records become rows on a rank (picklable, in the run plan): the tokenizer's
    folder, the row length, which tokens are labelled, whether rows are packed, the pad token.
    Said once for a stream and for a mixture of streams."""

    tokenizer_dir: str
    seq_len: int
    loss_on: str
    packing: bool
    pad_id: int


@dataclass(frozen=True, kw_only=True)
class StreamedSplit:
    """What a rank needs to stream its rows (picklable, in the run plan): the source and how its
    records become rows."""

    source: StreamedSource
    making: RowMaking
    pairs: ClassVar[bool] = False  # prompt and answer records only (components/data/checks.py)

    def start(self) -> StreamPosition:
        """The position before the first row."""
        return StreamPosition()

    def position_of(self, saved: dict) -> StreamPosition:
        return StreamPosition.of_json(saved)

    def rows(
        self,
        position: StreamPosition,
        labelling: Labelling,
        *,
        shard: tuple[int, int],
        rows_per_step: int,
    ) -> Iterator[tuple[list[Example], StreamPosition]]:
        """dp rank ``shard[1]``'s rows from ``position`` on (:func:`stream_rows`); a rank's rows
        are its own part of the stream, whatever ``rows_per_step``."""

        def open_epoch(epoch: int) -> datasets.IterableDataset:
            stream = self.source.open(dp_size=shard[0], dp_rank=shard[1])
            stream.set_epoch(epoch)
            return stream

        return stream_rows(position, open_epoch, labelling, self.making.packing)


def example_of(record: dict, labelling: Labelling, index: int) -> Example:
    """The record tokenized as the cached path tokenizes it (``tokenize_batch``).

    Raises:
        DataError: Naming the rank's record ``index`` (0-based), when it cannot be trained on.
    """
    batch = {column: [value] for column, value in record.items()}
    out = tokenize_batch(batch, labelling.tokenizer, labelling.seq_len, labelling.loss_on)
    if out["labelled"][0] <= 0:
        tokenizer, seq_len, loss_on = labelling.tokenizer, labelling.seq_len, labelling.loss_on
        raise DataError(f"the stream's {record_error(index, record, tokenizer, seq_len, loss_on)}")
    return out["input_ids"][0], out["labels"][0], out["labelled"][0]


def first_example(source: StreamedSource, labelling: Labelling) -> Example:
    """The source's first record tokenized: whether it can be streamed at all.

    Raises:
        DataError: One line, for a source that cannot be read or has no records, or a first record
            that cannot be trained on.
    """
    records = iter(source.open(dp_size=1, dp_rank=0))
    try:
        first = next(records, None)
    except Exception as error:  # datasets and pyarrow raise many kinds: one line naming the path
        why = _first_line(error)
        raise DataError(f"data.path={source.path!r} cannot be streamed: {why}") from None
    if first is None:
        raise DataError(f"data.path={source.path!r} has no records to stream")
    return example_of(first, labelling, 0)


def check_dp_parts(sources: tuple[StreamedSource, ...], dp_size: int) -> None:
    """Every dp rank's part of each stream holds a record (``split_dataset_by_node``: by shard, or
    by record where there are fewer shards than ranks); rank 0's holds the first record, which
    :func:`first_example` read.

    Raises:
        DataError: One line naming the stream and the first dp rank whose part holds no record.
    """
    for source in sources:
        for dp_rank in range(1, dp_size):
            try:
                empty = next(iter(source.open(dp_size=dp_size, dp_rank=dp_rank)), None) is None
            except Exception as error:  # as first_example: one line naming the path
                why = _first_line(error)
                raise DataError(f"data.path={source.path!r} cannot be streamed: {why}") from None
            if empty:
                raise DataError(
                    f"data.path={source.path!r} holds too few records for dp={dp_size}: dp rank "
                    f"{dp_rank}'s part of the stream has none; use fewer dp ranks or more records"
                )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def stream_rows(
    position: StreamPosition,
    open_epoch: Callable[[int], datasets.IterableDataset],
    labelling: Labelling,
    packing: bool,
) -> Iterator[tuple[list[Example], StreamPosition]]:
    """Rows from ``position`` on, each with the position after it: one example a row, or packed
    next fit up to ``labelling.seq_len``; an epoch's last row ends with the epoch, and the next
    epoch (``open_epoch(epoch)``) reads the records again from the start.

    Raises:
        DataError: If an epoch holds no record at all, or a record cannot be trained on.
    """
    epoch, state, row = position.epoch, position.stream, list(position.carry)
    records = position.records
    while True:
        stream, read = open_epoch(epoch), state is not None
        if state is not None:
            stream.load_state_dict(state)
        for record in stream:
            example, read = example_of(record, labelling, records), True
            records += 1
            used = sum(len(ids) for ids, _, _ in row)
            if row and (not packing or used + len(example[0]) > labelling.seq_len):
                after = dict(stream=stream.state_dict(), carry=(example,), records=records)
                yield row, StreamPosition(epoch=epoch, **after)
                row = []
            row.append(example)
        if not read:
            raise DataError("a dp rank's part of the stream holds no records: use fewer dp ranks")
        if row:
            yield row, StreamPosition(epoch=epoch + 1, records=records)
        epoch, state, row = epoch + 1, None, []


class RowPosition(Protocol):
    """Where a dp rank's rows stand (a :class:`StreamPosition`, a mixture's ``MixPosition``)."""

    def as_json(self) -> dict: ...


class StreamedRows(Protocol):
    """A streamed split as a rank's worker reads it: a :class:`StreamedSplit`, or a mixture's
    (``components/data/stream_mixture.py``)."""

    tokenizer_dir: str
    seq_len: int
    loss_on: str
    pad_id: int

    def start(self) -> RowPosition: ...

    def position_of(self, saved: dict) -> RowPosition: ...

    def rows(
        self,
        position: RowPosition,
        labelling: Labelling,
        *,
        shard: tuple[int, int],
        rows_per_step: int,
    ) -> Iterator[tuple[list[Example], RowPosition]]: ...


@dataclass(kw_only=True)
class StepItem:
    """One step of one dp rank: its micro-batches, its rows' labelled and real tokens, and its
    stream's position after them."""

    batches: list[Batch]
    labelled: int
    tokens: int
    position: dict


def step_items(
    rows: Iterator[tuple[list[Example], StreamPosition]],
    rows_per_step: int,
    micro_batch_size: int,
    *,
    seq_len: int,
    pad_id: int,
    pad_multiple: int | None,
) -> Iterator[StepItem]:
    """Steps of ``rows_per_step`` rows in micro-batches of ``micro_batch_size``, padded as the
    cached path pads (to ``seq_len``, or with ``pad_multiple`` to the longest row rounded up to a
    multiple of it, the step's rows then sorted by length first)."""
    while True:
        chosen = list(itertools.islice(rows, rows_per_step))
        taken = [row for row, _ in chosen]
        if pad_multiple is not None:
            taken.sort(key=_row_tokens)
        batches = []
        for start in range(0, len(taken), micro_batch_size):
            part = taken[start : start + micro_batch_size]
            pairs = [[(ids, labels) for ids, labels, _ in row] for row in part]
            width = batch_width(max(map(_row_tokens, part)), seq_len, pad_multiple)
            batches.append(collate_rows(pairs, width, pad_id))
        yield StepItem(
            batches=batches,
            labelled=sum(labelled for row in taken for _, _, labelled in row),
            tokens=sum(map(_row_tokens, taken)),
            position=chosen[-1][1].as_json(),
        )


def _row_tokens(row: list[Example]) -> int:
    return sum(len(ids) for ids, _, _ in row)


class _StepStream(torch.utils.data.IterableDataset):
    """One dp rank's steps from ``position`` on, made in the DataLoader's worker process: the
    tokenizer is loaded and the stream (a mixture's: its sources' streams) opened there."""

    def __init__(
        self,
        split: StreamedRows,
        shard: tuple[int, int],
        rows: tuple[int, int],
        position: RowPosition,
        pad_multiple: int | None,
    ):
        super().__init__()
        self.split, self.shard, self.rows = split, shard, rows
        self.position, self.pad_multiple = position, pad_multiple

    def __iter__(self) -> Iterator[StepItem | str]:
        """The steps, or after the last one a record that cannot be trained on: its one line
        (which the rank raises as a DataError, not torch's wrapped traceback)."""
        try:
            yield from self._steps()
        except DataError as error:
            yield str(error)

    def _steps(self) -> Iterator[StepItem]:
        split, making = self.split, self.split.making
        tokenizer = AutoTokenizer.from_pretrained(making.tokenizer_dir, trust_remote_code=False)
        labelling = Labelling(tokenizer=tokenizer, seq_len=making.seq_len, loss_on=making.loss_on)
        rows_per_step = self.rows[0]
        rows = split.rows(self.position, labelling, shard=self.shard, rows_per_step=rows_per_step)
        sizes = dict(seq_len=making.seq_len, pad_id=making.pad_id, pad_multiple=self.pad_multiple)
        return step_items(rows, *self.rows, **sizes)


def _dies_with_rank(parent: int) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        die_with_parent(parent)  # a killed rank leaves no worker reading on

    return init


class StreamBatches:
    """One dp rank's micro-batches of each step, read in order from the stream (or a mixture's
    streams, ``components/data/stream_mixture.py``) a worker process tokenizes and packs ahead;
    the token counts of a whole step (summed over the dp ranks of
    ``group``, one small all-reduce a step); the position, saved and restored with the checkpoint
    (:meth:`state_dict`, :meth:`load_state_dict`)."""

    def __init__(
        self,
        split: StreamedRows,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        dp_size: int,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        pad_multiple: int | None = None,
    ):
        self.split, self.group, self.pad_multiple = split, group, pad_multiple
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.position = split.start()  # after the last step read
        self._items: Iterator[StepItem] | None = None
        self._step: int | None = None
        self._item: StepItem | None = None
        self._counts: tuple[int, int] = (0, 0)

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _read(self, step: int) -> StepItem:
        """Step ``step``'s item: the one read, or the next from the worker (steps in order)."""
        if self._step == step:
            return self._item
        if self._step is not None and step != self._step + 1:
            raise ValueError(f"a stream is read in order: step {step + 1} after {self._step + 1}")
        if self._items is None:
            self._items = iter(self._loader())
        item = next(self._items)
        if isinstance(item, str):  # the worker's one line about a record
            raise DataError(item)
        counts = torch.tensor([item.labelled, item.tokens], dtype=torch.int64)
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.group)
        self._step, self._item, self._counts = step, item, tuple(counts.tolist())
        self.position = self.split.position_of(item.position)
        return item

    def _loader(self) -> torch.utils.data.DataLoader:
        rows = (self.global_batch_size // self.dp_size, self.micro_batch_size)
        shard = (self.dp_size, self.dp_rank)
        steps = _StepStream(self.split, shard, rows, self.position, self.pad_multiple)
        return torch.utils.data.DataLoader(
            steps,
            batch_size=None,
            num_workers=1,
            prefetch_factor=2,
            multiprocessing_context="fork",  # the plan and the imports are the rank's already
            worker_init_fn=_dies_with_rank(os.getpid()),
        )

    def batches_for_step(self, step: int) -> list[Batch]:
        """This dp rank's micro-batches of ``step`` (0-based; the steps are read in order)."""
        return self._read(step).batches

    def labels_in_step(self, step: int) -> int:
        """Labelled tokens of ``step`` over every dp rank's rows."""
        self._read(step)
        return self._counts[0]

    def tokens_in_step(self, step: int) -> int:
        """Real input tokens of ``step`` over every dp rank's rows."""
        self._read(step)
        return self._counts[1]

    def state_dict(self) -> dict[str, Any]:
        """Every dp rank's position after the last step read (collective over ``group``)."""
        positions = [self.position.as_json()]
        if self.dp_size > 1:
            positions = [None] * self.dp_size
            dist.all_gather_object(positions, self.position.as_json(), group=self.group)
        return {"dp": self.dp_size, "positions": positions}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from this dp rank's saved position (before the first step is read).

        Raises:
            ValueError: If the positions were saved at another dp (the checks refuse that first).
        """
        if saved["dp"] != self.dp_size:
            raise ValueError(f"a stream saved at dp={saved['dp']} resumes at that dp only")
        self.position = self.split.position_of(saved["positions"][self.dp_rank])


def open_loaders(
    train: TokenizedSplit | MixedSplit | StreamedRows,
    val: TokenizedSplit | MixedSplit | None,
    val_sources: dict[str, TokenizedSplit],
    global_batch_size: int,
    micro_batch_size: int,
    *,
    dp_size: int,
    dp_rank: int,
    seed: int,
    group: dist.ProcessGroup | None,
    pad_multiple: int | None = None,
) -> tuple[StepBatches | StreamBatches, StepBatches | None, dict[str, StepBatches]]:
    """A rank's loaders of the prepared data: training, validation (None when nothing is held out)
    and a mixture's sources' validation by name (:func:`open_splits`, :func:`open_source_vals`);
    a streamed source's (or mixture's) training rows from its worker, its dp ranks' counts summed
    over ``group`` (no validation)."""
    sizes = (global_batch_size, micro_batch_size)
    if not isinstance(train, TokenizedSplit | MixedSplit):
        where = dict(dp_size=dp_size, dp_rank=dp_rank, group=group, pad_multiple=pad_multiple)
        return StreamBatches(train, *sizes, **where), None, {}
    shards = dict(dp_size=dp_size, dp_rank=dp_rank, seed=seed, pad_multiple=pad_multiple)
    data, val_data = open_splits(train, val, *sizes, **shards)
    return data, val_data, open_source_vals(val_sources, micro_batch_size, **shards)
