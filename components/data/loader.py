"""Deterministic, resumable batches: the sequences of any optimizer step follow from the step number alone.

Step ``s`` takes positions ``s * global_batch_size ...`` of an endless stream made of one seeded permutation
of the dataset per epoch (epoch ``e`` shuffled with ``seed + e``), so resuming at step ``k`` needs no loader
state and every record appears once per epoch. The global batch is cut into ``dp_size`` contiguous parts
(dp rank ``r`` takes part ``r``; every tensor-parallel rank of that dp rank builds the same loader and gets
the same part), and each part into micro-batches for gradient accumulation.
"""

import random
from functools import lru_cache

import torch

from components.data.collate import labelled_tokens, pad_batch, tokenize_records

Batch = tuple[torch.Tensor, torch.Tensor]


def pad_id_of(tokenizer) -> int:
    """The id to pad inputs with: the tokenizer's pad token, else its eos (padding is masked out of the loss).

    Raises:
        ValueError: If the tokenizer has neither.
    """
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(f"tokenizer {type(tokenizer).__name__} has no pad or eos token to pad batches with")


class StepBatches:
    """One dp rank's micro-batches of any optimizer step, and the labelled-token count of a whole step.

    ``records`` are ``{"prompt", "response"}`` or ``{"messages"}`` dicts; they are tokenized once here with
    ``tokenize_records`` (prompt masked, answer labelled, cut to ``seq_len``).

    Raises:
        ValueError: If there are no records, a size is below 1, ``dp_rank`` is not in ``range(dp_size)``, or
            ``global_batch_size`` is not divisible by ``micro_batch_size × dp_size``.
        DataError: If a record's answer lies entirely beyond ``seq_len``.
    """

    def __init__(
        self,
        records: list[dict],
        global_batch_size: int,
        micro_batch_size: int,
        *,
        tokenizer,
        seq_len: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
    ):
        if not records:
            raise ValueError("no records to batch: the dataset (or its validation split) is empty")
        sizes = {"train.global_batch_size": global_batch_size, "train.micro_batch_size": micro_batch_size}
        for name, value in (sizes | {"dp": dp_size}).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"train.global_batch_size ({global_batch_size}) must be divisible by train.micro_batch_size "
                f"({micro_batch_size}) × dp ({dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in 0..{dp_size - 1} for dp ({dp_size})")
        self.examples = tokenize_records(records, tokenizer, seq_len)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.pad_id = pad_id_of(tokenizer)
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self._labelled = [labelled_tokens(labels) for _, labels in self.examples]
        self._permutation = lru_cache(maxsize=4)(self._shuffle)

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient-accumulation steps: micro-batches per dp rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def _batches(self, indices: list[int]) -> list[Batch]:
        micro = self.micro_batch_size
        return [
            pad_batch([self.examples[i] for i in indices[start : start + micro]], self.seq_len, self.pad_id)
            for start in range(0, len(indices), micro)
        ]

    def indices_for_step(self, step: int) -> list[int]:
        """Record indices of the whole global batch of ``step`` (0-based), in order; dp parts are slices."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        size = len(self.examples)
        start = step * self.global_batch_size
        return [self._permutation(p // size)[p % size] for p in range(start, start + self.global_batch_size)]

    def batches_for_step(self, step: int) -> list[Batch]:
        """This dp rank's ``micro_batches_per_step`` (input_ids, labels) pairs of ``step``, each
        [micro_batch_size, seq_len]; labels are aligned with the inputs (``cross_entropy_sum`` shifts)."""
        part_size = self.global_batch_size // self.dp_size
        part = self.indices_for_step(step)[self.dp_rank * part_size : (self.dp_rank + 1) * part_size]
        return self._batches(part)

    def tokens_in_step(self, step: int) -> int:
        """Labelled tokens (``labels[:, 1:] != -100``) in the whole global batch of ``step``: every dp rank and
        micro-batch. Dividing each micro-batch's loss sum by it makes the summed gradients the global mean's."""
        return sum(self._labelled[i] for i in self.indices_for_step(step))

    def all_batches(self) -> list[Batch]:
        """This dp rank's share of every record once, in record order, in micro-batches (the last may be
        smaller), for a validation loss. Every dp rank gets the same number and sizes of micro-batches (as
        sharded data parallelism needs), so the ``len(records) % dp_size`` last records are left out;
        ``global_batch_size`` plays no part.

        Raises:
            ValueError: If there are fewer records than dp ranks.
        """
        part_size = len(self.examples) // self.dp_size
        if part_size == 0:
            raise ValueError(
                f"{len(self.examples)} records cannot be shared by dp ({self.dp_size}) ranks: "
                "raise data.val_fraction or use more data"
            )
        return self._batches(list(range(self.dp_rank * part_size, (self.dp_rank + 1) * part_size)))


def split_train_val(records: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """(train, val): a seeded random ``val_fraction`` of the records held out, each side in original order.

    At least one record goes to validation when ``val_fraction`` > 0, and at least one stays for training.

    Raises:
        ValueError: If ``val_fraction`` is not in [0, 1) or leaves no training record.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n_val = max(1, round(len(records) * val_fraction)) if val_fraction > 0 else 0
    if n_val >= len(records):
        raise ValueError(
            f"data.val_fraction ({val_fraction}) of {len(records)} records leaves none for training: "
            "lower it or add records"
        )
    held_out = set(random.Random(seed).sample(range(len(records)), n_val))
    train = [record for index, record in enumerate(records) if index not in held_out]
    val = [record for index, record in enumerate(records) if index in held_out]
    return train, val
