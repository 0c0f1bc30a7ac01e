"""Packing: several examples per row up to ``seq_len``, greedy, in the order given, so it is
deterministic.

A row is a run of consecutive examples (next-fit: an example that does not fit in what is left of
the row starts the next one), so a packed split is described by its row boundaries alone and the
tokenized examples stay as they are. Unpacked, every example is its own row. Within a row, position
ids restart at each example; Hugging Face models then keep attention inside each example
(``transformers.masking_utils`` finds the restarts and builds a block-diagonal causal mask, or the
kernel's variable-length path).
"""

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Rows:
    """The rows of one split: row ``r`` holds examples ``order[offsets[r]:offsets[r + 1]]`` of the
    tokenized set, with ``tokens[r]`` real (non-padding) tokens of which ``labelled[r]`` count in
    the loss. Small: a rank reads these, never a whole column of the tokenized set."""

    order: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    labelled: np.ndarray

    def save_into(self, arrays: dict[str, np.ndarray], part: str) -> None:
        """Put the fields into ``arrays`` under ``<part>_<field>`` (for one ``np.savez`` of every
        part)."""
        arrays.update({f"{part}_{field.name}": getattr(self, field.name) for field in fields(self)})

    @classmethod
    def load_from(cls, arrays, part: str) -> "Rows":
        """The ``part`` fields of an ``np.load``-ed file written with :meth:`save_into`."""
        return cls(**{field.name: arrays[f"{part}_{field.name}"] for field in fields(cls)})


def build_rows(
    lengths: np.ndarray,
    labelled: np.ndarray,
    order: np.ndarray,
    seq_len: int,
    packing: bool,
    group: int = 1,
) -> Rows:
    """The rows of the examples ``order`` (indices into per-example ``lengths`` and ``labelled``),
    packed or one per row; ``group`` > 1: each row the ``group`` consecutive examples of one record
    (a preference pair's chosen and rejected conversations), never packed."""
    order = np.asarray(order, dtype=np.int64)
    offsets = row_offsets(np.asarray(lengths)[order], seq_len, packing, group)
    starts = offsets[:-1]
    if not len(order):
        empty = np.zeros(0, dtype=np.int32)
        return Rows(order=order, offsets=offsets, tokens=empty, labelled=empty)
    tokens = np.add.reduceat(np.asarray(lengths, dtype=np.int32)[order], starts).astype(np.int32)
    labels = np.add.reduceat(np.asarray(labelled, dtype=np.int32)[order], starts).astype(np.int32)
    return Rows(order=order, offsets=offsets, tokens=tokens, labelled=labels)


def row_offsets(lengths: np.ndarray, seq_len: int, packing: bool, group: int = 1) -> np.ndarray:
    """Row boundaries over examples of these token ``lengths``: row ``r`` holds examples
    ``offsets[r]`` .. ``offsets[r + 1] - 1``. Unpacked, ``offsets`` is ``0, group, 2·group, ...,
    len(lengths)``.

    Raises:
        ValueError: If an example is longer than ``seq_len`` (tokenize with truncation to it), or
            grouped examples are to be packed or do not come in whole groups.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError(
            f"an example has {int(lengths.max())} tokens, more than seq_len ({seq_len})"
        )
    if group > 1 and (packing or len(lengths) % group):
        raise ValueError(
            f"records of {group} examples are neither packed nor split: packing {packing}, "
            f"{len(lengths)} examples"
        )
    if not packing:
        return np.arange(0, len(lengths) + 1, group, dtype=np.int64)
    starts, used = [], seq_len
    for index, length in enumerate(lengths.tolist()):
        if used + length > seq_len:
            starts.append(index)
            used = 0
        used += length
    return np.asarray([*starts, len(lengths)], dtype=np.int64)


def packing_efficiency(lengths: np.ndarray, offsets: np.ndarray, seq_len: int) -> float:
    """Share of the rows' positions that hold real tokens (1.0: no padding at all)."""
    rows = len(offsets) - 1
    return float(np.asarray(lengths).sum()) / (rows * seq_len) if rows else 0.0
