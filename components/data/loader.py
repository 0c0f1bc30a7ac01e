"""Deterministic, resumable batches: the rows of any optimizer step follow from the step number
alone.

A row is one example, or several packed ones (:mod:`components.data.packing`). Step ``s`` takes
positions ``s * global_batch_size ...`` of an endless stream made of one seeded permutation of the
rows per epoch (epoch ``e`` shuffled with ``seed + e``), so resuming at step ``k`` needs no loader
state and every row appears once per epoch. The global batch is cut into ``dp_size`` contiguous
parts (dp rank ``r`` takes part ``r``; every tensor-parallel rank of that dp rank builds the same
loader and gets the same part), and each part into micro-batches for gradient accumulation.

The tokenized examples are an Arrow dataset, memory-mapped when opened from the folder the launcher
prepared (:func:`components.data.prepare.prepare_data`): a rank reads only the rows of its steps,
and holds per row just a few integers.
"""

import array
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import datasets
import numpy as np
import torch

from components.data.collate import IGNORE_INDEX, Labelling, record_error, tokenize_batch
from components.data.mixture import integer_weights, interleave
from components.data.packing import Rows, build_rows, concatenated_rows

# A row of no example: ``pad_id`` tokens, no labels. :meth:`StepBatches.all_batches` fills a dp
# rank's share with it so every rank runs as many rows as the others; it adds nothing to a loss sum
# or a labelled-token count.
PAD_ROW = -1


@dataclass(frozen=True, kw_only=True)
class TokenizedSplit:
    """What a rank needs to open one prepared split (:func:`components.data.prepare.prepare_data`
    makes it): the Arrow folder of tokenized examples, the row file, and which part of it (train or
    val) to read."""

    tokens_dir: str
    rows_file: str
    part: str  # "train" or "val"
    seq_len: int
    pad_id: int
    num_examples: int
    num_rows: int
    pairs: bool = False  # each row a preference pair: its chosen and rejected conversations


@dataclass(frozen=True, kw_only=True)
class MixedSplit:
    """One split of a mixture: each source's prepared split with its name and weight, read as one
    stream (:mod:`components.data.mixture` says which source each position takes)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    parts: tuple[TokenizedSplit, ...]

    @property
    def seq_len(self) -> int:
        return self.parts[0].seq_len

    @property
    def pad_id(self) -> int:
        return self.parts[0].pad_id

    @property
    def num_examples(self) -> int:
        return sum(part.num_examples for part in self.parts)

    @property
    def num_rows(self) -> int:
        return sum(part.num_rows for part in self.parts)

    @property
    def pairs(self) -> bool:
        """Never: a mixture mixes prompt and answer records (components/data/checks.py)."""
        return False


class MixedOrder:
    """The rows of positions of a mixture's training stream: source ``s``'s ``k``-th row is row
    ``k mod n_s`` of its ``k // n_s``-th epoch's seeded permutation (a source that runs out is
    recycled), offset by the rows of the sources before it."""

    def __init__(self, weights: list[float], sizes: list[int], seed: int):
        self.weights = integer_weights(weights)
        self.sizes, self.seed = sizes, seed
        self.firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._permutation = lru_cache(maxsize=16)(shuffled_rows)

    def rows(self, start: int, count: int) -> list[int]:
        """The rows of positions ``start .. start + count - 1``."""
        chosen = []
        for source, k in interleave(self.weights, start, count):
            size = self.sizes[source]
            order = self._permutation(size, self.seed + k // size)
            chosen.append(int(self.firsts[source] + order[k % size]))
        return chosen

    def sources(self, start: int, count: int) -> list[int]:
        """The source of each position ``start .. start + count - 1``."""
        return [source for source, _ in interleave(self.weights, start, count)]


def shuffled_rows(num_rows: int, seed: int) -> np.ndarray:
    """``random.Random(seed).shuffle`` of ``0 .. num_rows - 1`` (the order a list of them gets), in
    an 8-byte-per-row array: a list of a million Python ints would cost ~40 MB per rank for a
    moment."""
    order = array.array("q", range(num_rows))
    random.Random(seed).shuffle(order)
    return np.frombuffer(order, dtype=np.int64)


@dataclass(kw_only=True)
class Batch:
    """One micro-batch, every tensor [rows, positions] (``seq_len``, or its longest row's).
    ``labels`` are aligned with the inputs (the loss shifts them); ``position_ids`` restart at each
    packed example, which is how the model keeps attention inside examples (no attention mask is
    passed: Hugging Face builds the block-diagonal causal mask from the restarts, and would not look
    for them if a mask were given)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    real_tokens: (
        torch.Tensor
    )  # [rows]: each row's examples fill its first real_tokens positions; padding follows

    def to(self, device: torch.device | str) -> "Batch":
        names = ("input_ids", "labels", "position_ids", "real_tokens")
        return Batch(**{name: getattr(self, name).to(device) for name in names})

    def real_mask(self) -> torch.Tensor:
        """[rows, seq_len]: True where a position holds an example's token, False on the padding."""
        positions = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return positions < self.real_tokens.unsqueeze(1)

    def labelled_tokens(self) -> int:
        """Positions the loss counts: shifted labels that are not -100."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def _opened(parts: tuple[TokenizedSplit, ...]) -> tuple[datasets.Dataset, Rows]:
    """The tokens and rows of prepared splits, one after another (one split: as it is)."""
    tokens, rows = [], []
    for part in parts:
        tokens.append(open_tokens(part.tokens_dir))
        with np.load(part.rows_file) as arrays:
            rows.append(Rows.load_from(arrays, part.part))
    if len(parts) == 1:
        return tokens[0], rows[0]
    return datasets.concatenate_datasets(tokens), concatenated_rows(rows, [len(t) for t in tokens])


def open_tokens(tokens_dir: str) -> datasets.Dataset:
    """The tokenized examples in ``tokens_dir`` (``prepare_data``'s Arrow files, in order),
    memory-mapped."""
    files = sorted(Path(tokens_dir).glob("*.arrow"))
    if not files:
        raise FileNotFoundError(
            f"no tokenized data (*.arrow) in {tokens_dir}: run prepare_data first"
        )
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(file)) for file in files])


def pad_id_of(tokenizer) -> int:
    """The id to pad inputs with: the tokenizer's pad token, else its eos (padding is masked out of
    the loss).

    Raises:
        ValueError: If the tokenizer has neither.
    """
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(
        f"tokenizer {type(tokenizer).__name__} has no pad or eos token to pad batches with"
    )


def collate_rows(rows: list[list[tuple[list[int], list[int]]]], seq_len: int, pad_id: int) -> Batch:
    """A Batch of rows, each a list of (input_ids, labels) examples laid end to end and
    right-padded.

    Positions restart at 0 at each example and run on through the padding after the last one, so a
    row of one example has positions ``0 .. seq_len - 1``, like an unpacked row.

    Raises:
        ValueError: If a row's examples hold more than ``seq_len`` tokens, or an example's ids and
            labels differ in length.
    """
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.arange(seq_len, dtype=torch.long).repeat(len(rows), 1)
    real_tokens = torch.zeros(len(rows), dtype=torch.long)
    for row, examples in enumerate(rows):
        start = 0
        for ids, row_labels in examples:
            end = start + len(ids)
            if len(ids) != len(row_labels) or end > seq_len:
                raise ValueError(
                    f"row {row} does not fit: an example of {len(ids)} ids and {len(row_labels)} "
                    "labels at "
                    f"position {start}; ids and labels must be equal in length and end within "
                    f"seq_len ({seq_len})"
                )
            input_ids[row, start:end] = torch.tensor(ids, dtype=torch.long)
            labels[row, start:end] = torch.tensor(row_labels, dtype=torch.long)
            position_ids[row, start:] = torch.arange(seq_len - start)
            start = end
        real_tokens[row] = start
    return Batch(
        input_ids=input_ids, labels=labels, position_ids=position_ids, real_tokens=real_tokens
    )


def _check_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> None:
    sizes = {
        "train.global_batch_size": global_batch_size,
        "train.micro_batch_size": micro_batch_size,
    }
    for name, value in (sizes | {"dp": dp_size}).items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"train.global_batch_size ({global_batch_size}) must be divisible by "
            "train.micro_batch_size "
            f"({micro_batch_size}) × dp ({dp_size})"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in 0..{dp_size - 1} for dp ({dp_size})")


class StepBatches:
    """One dp rank's micro-batches of any optimizer step, and the token counts of a whole step.

    ``tokens`` is a tokenized dataset (columns ``input_ids`` and ``labels``, as
    :func:`components.data.collate.tokenize_batch` writes them); ``rows`` says which examples make
    each row of this split and how many tokens each row has. Build it with :meth:`open` on a
    prepared split, or :meth:`from_records` for a few records in memory. ``pad_multiple`` None pads
    every row to ``seq_len``; a number pads a micro-batch only to its longest row, rounded up to a
    multiple of it (at most ``seq_len``): the same losses, without computing on padding.

    Raises:
        ValueError: If there are no rows, a size is below 1, ``dp_rank`` is not in
            ``range(dp_size)``, or ``global_batch_size`` is not divisible by ``micro_batch_size ×
            dp_size``.
    """

    def __init__(
        self,
        tokens: datasets.Dataset,
        rows: Rows,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        seq_len: int,
        pad_id: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        pad_multiple: int | None = None,
    ):
        if len(rows.offsets) < 2:
            raise ValueError("no records to batch: the dataset (or its validation split) is empty")
        _check_sizes(global_batch_size, micro_batch_size, dp_size, dp_rank)
        self.tokens = tokens.select_columns(["input_ids", "labels"])
        self.rows = rows
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.seq_len, self.pad_id = seq_len, pad_id
        self.dp_size, self.dp_rank, self.seed = dp_size, dp_rank, seed
        self.pad_multiple = pad_multiple
        self._permutation = lru_cache(maxsize=2)(self._shuffle)
        self.mixture: MixedOrder | None = None  # a mixture's order of sources (open, MixedSplit)

    @classmethod
    def open(
        cls,
        split: TokenizedSplit,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        dp_size: int,
        dp_rank: int,
        seed: int,
        pad_multiple: int | None = None,
    ) -> "StepBatches":
        """The loader of a prepared split, its tokens memory-mapped from the launcher's cache
        folder; a mixture's split is its sources' rows one after another, its training stream
        interleaved by their weights (:class:`MixedOrder`)."""
        parts = split.parts if isinstance(split, MixedSplit) else (split,)
        tokens, rows = _opened(parts)
        sizes = dict(
            seq_len=split.seq_len, pad_id=split.pad_id, dp_size=dp_size, dp_rank=dp_rank, seed=seed
        )
        sizes["pad_multiple"] = pad_multiple
        loader = cls(tokens, rows, global_batch_size, micro_batch_size, **sizes)
        if isinstance(split, MixedSplit):
            counts = [part.num_rows for part in split.parts]
            loader.mixture = MixedOrder(list(split.weights), counts, seed)
        return loader

    @classmethod
    def from_records(
        cls,
        records: list[dict],
        global_batch_size: int,
        micro_batch_size: int,
        *,
        labelling: Labelling,
        dp_size: int,
        dp_rank: int,
        seed: int,
        packing: bool = False,
        pad_multiple: int | None = None,
    ) -> "StepBatches":
        """The loader of a few records tokenized in memory, all of them in order (tests,
        benchmarks), as ``labelling`` says.

        Raises:
            DataError: If a record cannot be trained on (named by its index).
            ValueError: As the constructor, e.g. for no records.
        """
        if not records:
            raise ValueError("no records to batch: the dataset (or its validation split) is empty")
        tokenizer, seq_len, loss_on = labelling.tokenizer, labelling.seq_len, labelling.loss_on
        raw = datasets.Dataset.from_list(records)
        tokens = raw.map(
            tokenize_batch,
            batched=True,
            fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "loss_on": loss_on},
            remove_columns=raw.column_names,
            keep_in_memory=True,
        )
        labelled = tokens.data.column("labelled").to_numpy()
        if len(labelled) and labelled.min() <= 0:
            index = int(np.flatnonzero(labelled <= 0)[0])
            raise record_error(index, records[index], tokenizer, seq_len, loss_on)
        lengths = tokens.data.column("length").to_numpy()
        rows = build_rows(lengths, labelled, np.arange(len(records)), seq_len, packing)
        sizes = dict(
            seq_len=seq_len,
            pad_id=pad_id_of(tokenizer),
            dp_size=dp_size,
            dp_rank=dp_rank,
            seed=seed,
        )
        sizes["pad_multiple"] = pad_multiple
        return cls(tokens, rows, global_batch_size, micro_batch_size, **sizes)

    @property
    def num_rows(self) -> int:
        return len(self.rows.offsets) - 1

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient-accumulation steps: micro-batches per dp rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _shuffle(self, epoch: int) -> np.ndarray:
        return shuffled_rows(self.num_rows, self.seed + epoch)

    def _batches(self, rows: list[int]) -> list[Batch]:
        batches = []
        for start in range(0, len(rows), self.micro_batch_size):
            chosen = rows[start : start + self.micro_batch_size]
            spans = [self._span(r) for r in chosen]
            examples = self.tokens[[int(i) for a, b in spans for i in self.rows.order[a:b]]]
            pairs = iter(zip(examples["input_ids"], examples["labels"], strict=True))
            rows_of_pairs = [[next(pairs) for _ in range(b - a)] for a, b in spans]
            batches.append(collate_rows(rows_of_pairs, self._width(chosen), self.pad_id))
        return batches

    def _span(self, row: int) -> tuple[int, int]:
        """Where ``row``'s examples lie in ``rows.order``: none for :data:`PAD_ROW`."""
        if row == PAD_ROW:
            return 0, 0
        return int(self.rows.offsets[row]), int(self.rows.offsets[row + 1])

    def _width(self, rows: list[int]) -> int:
        """Positions of a micro-batch of ``rows``: ``seq_len``, or its longest row rounded up to a
        multiple of ``pad_multiple`` (causal attention keeps every real token's result the same);
        a micro-batch of :data:`PAD_ROW` alone is one multiple wide."""
        longest = max((int(self.rows.tokens[r]) for r in rows if r != PAD_ROW), default=1)
        return batch_width(longest, self.seq_len, self.pad_multiple)

    def indices_for_step(self, step: int) -> list[int]:
        """Row indices of the whole global batch of ``step`` (0-based), in order; dp parts are
        slices."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        size, start = self.num_rows, step * self.global_batch_size
        if self.mixture is not None:
            return self.mixture.rows(start, self.global_batch_size)
        return [
            int(self._permutation(p // size)[p % size])
            for p in range(start, start + self.global_batch_size)
        ]

    def batches_for_step(self, step: int) -> list[Batch]:
        """This dp rank's ``micro_batches_per_step`` Batches of ``step``, each [micro_batch_size,
        seq_len]. With ``pad_multiple`` the global batch's rows are sorted by length first (length
        buckets) and cut into micro-batches, dp=1's, which the dp ranks take in turn: each
        micro-batch holds rows of similar length, the step the same rows (the same loss, summed in
        another order), and every micro-batch the same rows at any dp (what a statistic of a
        micro-batch, an MoE load-balancing loss, reads); without it, dp rank r the r-th slice."""
        rows = self.indices_for_step(step)
        if self.pad_multiple is None:
            part_size = self.global_batch_size // self.dp_size
            return self._batches(rows[self.dp_rank * part_size : (self.dp_rank + 1) * part_size])
        rows = sorted(rows, key=lambda row: int(self.rows.tokens[row]))
        size = self.micro_batch_size
        micro_batches = [rows[start : start + size] for start in range(0, len(rows), size)]
        return self._batches(sum(micro_batches[self.dp_rank :: self.dp_size], []))

    def labels_in_step(self, step: int) -> int:
        """Labelled tokens (``labels[:, 1:] != -100``) in the whole global batch of ``step``: every
        dp rank and micro-batch. Dividing each micro-batch's loss sum by it makes the summed
        gradients the global mean's."""
        return int(self.rows.labelled[self.indices_for_step(step)].sum())

    def tokens_in_step(self, step: int) -> int:
        """Non-padding input tokens in the whole global batch of ``step`` (what ``tokens_per_s``
        counts)."""
        return int(self.rows.tokens[self.indices_for_step(step)].sum())

    def all_batches(self) -> list[Batch]:
        """This dp rank's share of every row once, in row order, in micro-batches (the last may be
        smaller), for a validation loss. Every dp rank gets the same number and sizes of
        micro-batches (as sharded data parallelism needs): the rows are cut into ``dp_size``
        contiguous shares, the first ``num_rows % dp_size`` one row longer, and each shorter
        share ends in one :data:`PAD_ROW`, which counts nothing, so the loss over the dp ranks is
        dp=1's; ``global_batch_size`` plays no part.

        Raises:
            ValueError: If there are fewer rows than dp ranks.
        """
        size, longer = divmod(self.num_rows, self.dp_size)
        if size == 0:
            raise ValueError(
                f"{self.num_rows} records cannot be shared by dp ({self.dp_size}) ranks: "
                "raise data.val_fraction or use more data"
            )
        longest = size + (longer > 0)  # every rank runs this many rows
        first = self.dp_rank * size + min(self.dp_rank, longer)
        mine = list(range(first, first + size + (self.dp_rank < longer)))
        return self._batches(mine + [PAD_ROW] * (longest - len(mine)))


class PairBatches(StepBatches):
    """:class:`StepBatches` of preference pairs: a row is a pair, its chosen and rejected
    conversations (``Rows`` of two examples each), and ``global_batch_size`` and
    ``micro_batch_size`` count pairs. A micro-batch of ``n`` pairs is ``2n`` rows, the ``n``
    chosen conversations then the ``n`` rejected ones, in the same order (TRL's layout), one
    conversation a row. A :data:`PAD_ROW` pair is two rows of no answer tokens: a loss of pairs
    must leave such a pair out (DPO's would be log 2: ``dpo_evaluate`` counts only real pairs)."""

    def _batches(self, rows: list[int]) -> list[Batch]:
        batches = []
        for start in range(0, len(rows), self.micro_batch_size):
            chosen = rows[start : start + self.micro_batch_size]
            spans = [self._span(r) for r in chosen if r != PAD_ROW]
            if any(b - a != 2 for a, b in spans):
                raise ValueError(
                    "a preference row must hold two conversations, chosen and rejected"
                )
            examples = self.tokens[[int(self.rows.order[a + k]) for k in (0, 1) for a, _ in spans]]
            real = iter(zip(examples["input_ids"], examples["labels"], strict=True))
            conversations = [
                ([], []) if row == PAD_ROW else next(real) for _ in (0, 1) for row in chosen
            ]
            longest = max(max(len(ids) for ids, _ in conversations), 1)
            width = batch_width(longest, self.seq_len, self.pad_multiple)
            batches.append(collate_rows([[one] for one in conversations], width, self.pad_id))
        return batches


def batch_width(longest: int, seq_len: int, pad_multiple: int | None) -> int:
    """Positions of a micro-batch whose longest row has ``longest`` tokens: ``seq_len`` without
    ``pad_multiple``, else ``longest`` rounded up to a multiple of it, at most ``seq_len``."""
    if pad_multiple is None:
        return seq_len
    return min(seq_len, -(-longest // pad_multiple) * pad_multiple)


def widest_batch(split: TokenizedSplit | MixedSplit, pad_multiple: int | None) -> int:
    """Positions of the widest micro-batch any step of ``split`` can make (its longest row's, as
    :func:`batch_width` pads it): what the dry run plans a micro-batch's tokens for. Of
    preference pairs, the longest conversation's: a pair is two rows of the micro-batch
    (:class:`PairBatches`), not one of both conversations' tokens."""
    if isinstance(split, MixedSplit):
        return max(widest_batch(part, pad_multiple) for part in split.parts)
    if not isinstance(split, TokenizedSplit):  # a stream's rows are not known before it is read
        return split.making.seq_len
    with np.load(split.rows_file) as arrays:
        rows = Rows.load_from(arrays, split.part)
    if not len(rows.tokens):
        longest = split.seq_len
    elif split.pairs:  # each example's length, of the split's examples
        lengths = open_tokens(split.tokens_dir).data.column("length").to_numpy()
        longest = int(lengths[rows.order].max())
    else:
        longest = int(rows.tokens.max())
    return batch_width(longest, split.seq_len, pad_multiple)


def open_splits(
    train: "TokenizedSplit | MixedSplit",
    val: "TokenizedSplit | MixedSplit | None",
    global_batch_size: int,
    micro_batch_size: int,
    *,
    dp_size: int,
    dp_rank: int,
    seed: int,
    pad_multiple: int | None = None,
) -> tuple[StepBatches, StepBatches | None]:
    """A rank's loaders of the prepared splits: training batches of ``global_batch_size``, and
    validation (None when nothing was held out) in global batches of one micro-batch per dp rank;
    preference pairs (``train.pairs``) as :class:`PairBatches`; each micro-batch padded to its
    longest row (a multiple of ``pad_multiple``) when that is given."""
    shards = dict(dp_size=dp_size, dp_rank=dp_rank, seed=seed, pad_multiple=pad_multiple)
    batches = PairBatches if train.pairs else StepBatches
    train_batches = batches.open(train, global_batch_size, micro_batch_size, **shards)
    if val is None:
        return train_batches, None
    return train_batches, batches.open(val, micro_batch_size * dp_size, micro_batch_size, **shards)


def open_source_vals(
    vals: dict[str, TokenizedSplit],
    micro_batch_size: int,
    *,
    dp_size: int,
    dp_rank: int,
    seed: int,
    pad_multiple: int | None = None,
) -> dict[str, StepBatches]:
    """A rank's validation loaders of a mixture's sources, by name (each as :func:`open_splits`
    opens a validation split); empty for a single source."""
    shards = dict(dp_size=dp_size, dp_rank=dp_rank, seed=seed, pad_multiple=pad_multiple)
    per_step = micro_batch_size * dp_size
    return {
        name: StepBatches.open(split, per_step, micro_batch_size, **shards)
        for name, split in vals.items()
    }
