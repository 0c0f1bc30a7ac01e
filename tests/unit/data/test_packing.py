"""Packing: next-fit rows of consecutive examples, deterministic, and well filled on short chat
examples."""

import random

import numpy as np
import pytest
import torch

from components.data.collate import Labelling
from components.data.generated import generate_examples
from components.data.loader import StepBatches, collate_rows
from components.data.packing import build_rows, packing_efficiency, row_offsets
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts


def test_next_fit_keeps_order_and_never_overflows():
    lengths = np.array([3, 4, 2, 6, 1, 1, 8, 5])
    offsets = row_offsets(lengths, 8, packing=True)
    assert offsets.tolist() == [0, 2, 4, 6, 7, 8]  # rows [3 4] [2 6] [1 1] [8] [5]
    rows = [lengths[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert all(total <= 8 for total in rows) and offsets[-1] == len(lengths)


def test_unpacked_rows_are_single_examples_and_too_long_is_refused():
    assert row_offsets(np.array([5, 9, 2]), 9, packing=False).tolist() == [0, 1, 2, 3]
    assert row_offsets(np.array([], dtype=np.int64), 9, packing=True).tolist() == [0]
    with pytest.raises(ValueError, match=r"an example has 10 tokens, more than seq_len \(9\)"):
        row_offsets(np.array([10]), 9, packing=True)


def test_collated_row_restarts_positions_and_masks_nothing_of_the_next_example():
    batch = collate_rows(
        [[([1, 2, 3], [-100, 2, 3]), ([1, 5], [-100, 5])], [([1, 7], [-100, 7])]], 6, pad_id=0
    )
    assert batch.input_ids.tolist() == [[1, 2, 3, 1, 5, 0], [1, 7, 0, 0, 0, 0]]
    assert batch.labels.tolist() == [[-100, 2, 3, -100, 5, -100], [-100, 7, -100, -100, -100, -100]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert batch.real_tokens.tolist() == [
        5,
        2,
    ]  # padding (here the pad id 0) is told apart by place, not by id
    assert batch.real_mask().tolist() == [[True] * 5 + [False], [True] * 2 + [False] * 4]
    assert batch.to("cpu").real_tokens.tolist() == [5, 2]
    with pytest.raises(ValueError, match=r"row 0 does not fit"):
        collate_rows([[([1, 2, 3], [1, 2, 3])]], 2, pad_id=0)


def chat_records(n: int, seed: int) -> list[dict]:
    """Short multi-turn chats (1-4 exchanges of the generated tasks, a system line in some)."""
    rng, pairs = random.Random(seed), iter(generate_examples(4 * n, seed))
    records = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            pair = next(pairs)
            messages += [
                {"role": "user", "content": pair["prompt"]},
                {"role": "assistant", "content": pair["response"]},
            ]
        records.append({"messages": messages})
    return records


def test_packing_short_chats_at_512_trains_many_times_more_real_tokens_per_step(tmp_path):
    records = chat_records(600, seed=0)
    tokenizer = train_tokenizer(training_texts(records), DEFAULT_VOCAB_SIZE, tmp_path)
    common = dict(
        labelling=Labelling(tokenizer=tokenizer, seq_len=512, loss_on="all_assistant"),
        dp_size=1,
        dp_rank=0,
        seed=0,
    )
    unpacked = StepBatches.from_records(records, 8, 8, **common)
    packed = StepBatches.from_records(records, 8, 8, **common, packing=True)
    steps = range(min(unpacked.num_rows, packed.num_rows) // 8)
    ratio = sum(packed.tokens_in_step(s) for s in steps) / sum(
        unpacked.tokens_in_step(s) for s in steps
    )
    lengths = [len(ids) for ids in packed.tokens["input_ids"]]
    full = packing_efficiency(lengths, packed.rows.offsets, 512)
    print(
        f"packing short chats at seq_len 512: {ratio:.1f}x real tokens per step, rows {full:.0%} "
        "full"
    )
    assert ratio >= 3
    first = packed.batches_for_step(0)
    assert sum(
        int((batch.input_ids != tokenizer.pad_token_id).sum()) for batch in first
    ) == packed.tokens_in_step(0)
    again = StepBatches.from_records(records, 8, 8, **common, packing=True).batches_for_step(
        0
    )  # deterministic
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again, strict=True))


def test_build_rows_counts_real_and_labelled_tokens_per_row():
    lengths, labelled = np.array([3, 4, 2, 6]), np.array([1, 2, 1, 3])
    rows = build_rows(lengths, labelled, np.array([0, 2, 3]), 8, packing=True)  # lengths 3, 2, 6
    assert rows.order.tolist() == [0, 2, 3] and rows.offsets.tolist() == [0, 2, 3]
    assert rows.tokens.tolist() == [5, 6] and rows.labelled.tolist() == [2, 3]
    unpacked = build_rows(lengths, labelled, np.array([1, 3]), 8, packing=False)
    assert unpacked.offsets.tolist() == [0, 1, 2] and unpacked.tokens.tolist() == [4, 6]
