"""A streamed mixture (``data=mix data.streaming=true``): each source a ``datasets`` stream,
tokenized and packed as one streamed source is (:func:`components.data.streaming.stream_rows`),
its rows drawn in the order of the cached mixture's interleave (:mod:`components.data.mixture`).

Position ``p`` of the global training stream takes its row from the source the interleave gives
``p``; step ``s`` holds positions ``s × global_batch_size ...``, cut into one contiguous part per
dp rank, as the cached mixture's. Each dp rank reads its own part of every source's stream, so a
rank's ``k``-th row of a source is the ``k``-th row of that source's part it reads. The position
after a row (the rows the rank has read, each source's stream position) is saved in the checkpoint
like a single stream's: a resume at the same dp continues exactly; at another dp it is refused.

Docs: docs/data.md
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from components.data.collate import Labelling
from components.data.mixture import integer_weights, interleave
from components.data.sources import MixSource
from components.data.streaming import (
    Example,
    RowMaking,
    StreamedSource,
    StreamedSplit,
    StreamPosition,
)


def is_streamed(source: object) -> bool:
    """Whether ``source`` is read as a stream: a streamed source, or a mixture of them."""
    if isinstance(source, MixSource):
        return all(isinstance(part.source, StreamedSource) for part in source.parts)
    return isinstance(source, StreamedSource)


@dataclass(frozen=True, kw_only=True)
class MixPosition:
    """Where one dp rank's streamed mixture stands between two rows: the ``read`` rows it has
    taken, and each source's stream position (:class:`StreamPosition`), in the sources' order."""

    read: int = 0
    sources: tuple[StreamPosition, ...]

    def as_json(self) -> dict:
        return {"read": self.read, "sources": [source.as_json() for source in self.sources]}

    @classmethod
    def of_json(cls, saved: dict) -> "MixPosition":
        sources = tuple(StreamPosition.of_json(source) for source in saved["sources"])
        return cls(read=saved["read"], sources=sources)


def mixed_rows(
    position: MixPosition,
    sources: list[Callable[[StreamPosition], Iterator[tuple[list[Example], StreamPosition]]]],
    weights: list[float],
    *,
    shard: tuple[int, int],
    rows_per_step: int,
) -> Iterator[tuple[list[Example], MixPosition]]:
    """One dp rank's rows from ``position`` on, each with the position after it: its ``n``-th
    row (counted from 0) sits at global position ``(n // r) × r × dp + dp_rank × r + n % r`` (``r``
    = ``rows_per_step``, ``shard`` = ``(dp, dp_rank)``), and is the next row of the source the
    interleave gives that position, read from ``sources[s](its position)``."""
    dp_size, dp_rank = shard
    scaled = integer_weights(weights)
    current = list(position.sources)
    readers = [rows_of(start) for rows_of, start in zip(sources, current, strict=True)]
    read = position.read
    while True:
        step, offset = divmod(read, rows_per_step)
        start = (step * dp_size + dp_rank) * rows_per_step + offset
        for source, _ in interleave(scaled, start, rows_per_step - offset):
            row, current[source] = next(readers[source])
            read += 1
            yield row, MixPosition(read=read, sources=tuple(current))


@dataclass(frozen=True, kw_only=True)
class StreamedMixSplit:
    """What a rank needs to stream a mixture's rows (picklable, in the run plan): the sources'
    ``names``, ``weights`` and streams, and how their records become rows (each source's as a
    stream alone makes them)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    sources: tuple[StreamedSource, ...]
    making: RowMaking
    pairs: ClassVar[bool] = False

    def start(self) -> MixPosition:
        """The position before the first row: every source at its start."""
        return MixPosition(sources=tuple(StreamPosition() for _ in self.sources))

    def position_of(self, saved: dict) -> MixPosition:
        return MixPosition.of_json(saved)

    def rows(
        self,
        position: MixPosition,
        labelling: Labelling,
        *,
        shard: tuple[int, int],
        rows_per_step: int,
    ) -> Iterator[tuple[list[Example], MixPosition]]:
        """dp rank ``shard[1]``'s rows of the mixture from ``position`` on (:func:`mixed_rows`)."""
        readers = [self._reader(source, labelling, shard) for source in self.sources]
        weights = list(self.weights)
        return mixed_rows(position, readers, weights, shard=shard, rows_per_step=rows_per_step)

    def _reader(
        self, source: StreamedSource, labelling: Labelling, shard: tuple[int, int]
    ) -> Callable[[StreamPosition], Iterator[tuple[list[Example], StreamPosition]]]:
        """Rows of ``source`` from a position on, as a streamed source alone makes them."""
        alone = StreamedSplit(source=source, making=self.making)
        return lambda start: alone.rows(start, labelling, shard=shard, rows_per_step=1)
