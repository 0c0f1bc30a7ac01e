"""StepBatches: dp parts partition the global batch, epochs cover every row, resuming from a step
reproduces."""

import pytest
import torch

from components.data.collate import IGNORE_INDEX, Labelling, tokenize_example
from components.data.generated import generate_examples
from components.data.loader import StepBatches, collate_rows, pad_id_of
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts

SEQ_LEN = 32
RECORDS = generate_examples(40, seed=5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(
        training_texts(RECORDS), DEFAULT_VOCAB_SIZE, tmp_path_factory.mktemp("tokenizer")
    )


@pytest.fixture
def loader(tokenizer):
    def make(n=23, global_batch_size=8, micro_batch_size=2, dp_size=2, dp_rank=0, seed=0, **more):
        return StepBatches.from_records(
            RECORDS[:n],
            global_batch_size,
            micro_batch_size,
            labelling=Labelling(tokenizer=tokenizer, seq_len=SEQ_LEN, loss_on="all_assistant"),
            dp_size=dp_size,
            dp_rank=dp_rank,
            seed=seed,
            **more,
        )

    return make


def _cat(batches) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches])


def _unpacked(records, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The records one per row, tokenized one by one: what the loader's rows must equal."""
    batch = collate_rows(
        [[tokenize_example(r, tokenizer, SEQ_LEN, "all_assistant")] for r in records],
        SEQ_LEN,
        tokenizer.pad_token_id,
    )
    return batch.input_ids, batch.labels


def test_micro_batches_have_the_configured_shape(loader):
    batches = loader(
        global_batch_size=8, micro_batch_size=2, dp_size=2, dp_rank=1
    ).batches_for_step(0)
    assert len(batches) == 2
    for batch in batches:
        assert (
            batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, SEQ_LEN)
        )
        assert batch.input_ids.dtype == torch.long
        assert torch.equal(
            batch.position_ids, torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
        )  # unpacked rows


def _rows(batches) -> list[tuple]:
    """Each row's real tokens and labels, and its positions over its whole width, sorted."""
    rows = []
    for batch in batches:
        for ids, labels, real in zip(batch.input_ids, batch.labels, batch.real_tokens, strict=True):
            assert (labels[real:] == -100).all()  # what lies after the real tokens is padding
            rows.append((ids[:real].tolist(), labels[:real].tolist()))
    return sorted(rows)


def test_pad_multiple_buckets_rows_by_length_and_pads_each_only_to_its_longest_row(loader):
    """The step's rows over both dp ranks are the same with and without length buckets (only
    padding went); with them each rank's micro-batches are every other one of dp=1's."""
    full = [loader(micro_batch_size=2, dp_rank=rank) for rank in (0, 1)]
    short = [loader(micro_batch_size=2, pad_multiple=8, dp_rank=rank) for rank in (0, 1)]
    alone = loader(micro_batch_size=2, pad_multiple=8, dp_size=1)
    widths = []
    for step in range(3):
        wide = [batch for rank in full for batch in rank.batches_for_step(step)]
        narrow = [batch for rank in short for batch in rank.batches_for_step(step)]
        assert _rows(narrow) == _rows(wide)  # the same rows, labels and counts
        dp1 = alone.batches_for_step(step)
        lengths = torch.cat([batch.real_tokens for batch in dp1]).tolist()
        assert lengths == sorted(lengths)  # length buckets: similar rows share a micro-batch
        for rank, batches in enumerate(rank.batches_for_step(step) for rank in short):
            assert [_rows([b]) for b in batches] == [_rows([b]) for b in dp1[rank::2]]
        for batch in narrow:
            width = batch.input_ids.shape[1]
            assert width == min(SEQ_LEN, -(-int(batch.real_tokens.max()) // 8) * 8)
            widths.append(width)
        assert short[0].labels_in_step(step) == full[0].labels_in_step(step)
    assert min(widths) < SEQ_LEN  # the generated records are short: batches got narrower


def test_dp_parts_are_disjoint_and_together_are_the_global_batch(loader, tokenizer):
    ranks = [
        loader(n=40, global_batch_size=12, micro_batch_size=2, dp_size=3, dp_rank=r)
        for r in range(3)
    ]
    for step in range(3):  # steps 0-2 lie inside the first epoch (40 records, 12 per step)
        indices = ranks[0].indices_for_step(step)
        assert len(set(indices)) == 12  # disjoint parts: no record twice in the step
        expected = _unpacked([RECORDS[i] for i in indices], tokenizer)
        together = _cat(sum((rank.batches_for_step(step) for rank in ranks), []))
        assert torch.equal(together[0], expected[0]) and torch.equal(together[1], expected[1])


def test_every_record_appears_once_per_epoch_and_epochs_reshuffle(loader):
    steps = loader(n=24, global_batch_size=8)
    epochs = [
        sum((steps.indices_for_step(step) for step in range(3 * e, 3 * e + 3)), [])
        for e in range(3)
    ]
    assert all(sorted(epoch) == list(range(24)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_epochs_roll_over_inside_a_step(loader):
    steps = loader(n=23, global_batch_size=8)
    stream = sum(
        (steps.indices_for_step(step) for step in range(6)), []
    )  # 48 positions: two epochs and 2
    assert sorted(stream[:23]) == sorted(stream[23:46]) == list(range(23))
    assert stream[:23] != stream[23:46]


def test_resuming_at_a_step_gives_the_same_batches_as_running_through(loader):
    running = loader(seed=7, dp_rank=1)
    through = {step: running.batches_for_step(step) for step in range(8)}
    resumed = loader(seed=7, dp_rank=1)
    for step in range(5, 8):
        for a, b in zip(through[step], resumed.batches_for_step(step), strict=True):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_the_seed_changes_the_order_and_tp_ranks_of_one_dp_rank_agree(loader):
    assert loader(seed=0).indices_for_step(0) != loader(seed=1).indices_for_step(0)
    tp0, tp1 = (
        loader(dp_rank=1),
        loader(dp_rank=1),
    )  # two TP ranks of dp rank 1 build their own loaders
    pairs = zip(tp0.batches_for_step(3), tp1.batches_for_step(3), strict=True)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in pairs)


def test_step_counts_cover_every_part_labels_shifted_and_tokens_without_padding(loader, tokenizer):
    ranks = [
        loader(global_batch_size=12, micro_batch_size=3, dp_size=2, dp_rank=r) for r in range(2)
    ]
    for step in range(4):
        batches = [batch for rank in ranks for batch in rank.batches_for_step(step)]
        labelled = sum(batch.labelled_tokens() for batch in batches)
        real = sum(int((batch.input_ids != tokenizer.pad_token_id).sum()) for batch in batches)
        assert ranks[0].labels_in_step(step) == ranks[1].labels_in_step(step) == labelled > 0
        assert ranks[0].tokens_in_step(step) == ranks[1].tokens_in_step(step) == real > labelled


@pytest.mark.parametrize("dp_size", [2, 3])
def test_all_batches_share_every_record_once_equally_over_dp_ranks(loader, tokenizer, dp_size):
    """11 rows at dp=2 (6 + 5) and dp=3 (4 + 4 + 3): every row once, in order, and each shorter
    share ends in one unlabelled row of padding, so every rank runs micro-batches of the same
    sizes and the labelled tokens are dp=1's."""
    ranks = [
        loader(n=11, global_batch_size=2 * dp_size, micro_batch_size=2, dp_size=dp_size, dp_rank=r)
        for r in range(dp_size)
    ]
    shares = [rank.all_batches() for rank in ranks]
    sizes = [[batch.input_ids.shape[0] for batch in share] for share in shares]
    assert sizes == ([[2, 2, 2]] * 2 if dp_size == 2 else [[2, 2]] * 3)
    rows = [(ids, labels) for share in shares for ids, labels in zip(*_cat(share), strict=True)]
    padding = [(ids, labels) for ids, labels in rows if (labels == IGNORE_INDEX).all()]
    real = [(ids, labels) for ids, labels in rows if not (labels == IGNORE_INDEX).all()]
    expected = _unpacked(RECORDS[:11], tokenizer)
    assert torch.equal(torch.stack([ids for ids, _ in real]), expected[0])
    assert torch.equal(torch.stack([labels for _, labels in real]), expected[1])
    assert len(padding) == len(rows) - 11 == dp_size - 11 % dp_size
    assert all((ids == tokenizer.pad_token_id).all() for ids, _ in padding)
    ends_in_padding = [share[-1].real_tokens[-1].item() == 0 for share in shares]
    assert ends_in_padding == [rank >= 11 % dp_size for rank in range(dp_size)]
    labelled = sum(batch.labelled_tokens() for share in shares for batch in share)
    assert labelled == sum(b.labelled_tokens() for b in loader(n=11, dp_size=1).all_batches())


def test_a_micro_batch_of_padding_alone_is_one_pad_multiple_wide(loader):
    """9 rows at dp=2 in micro-batches of 4: rank 1's second micro-batch is its padding row alone,
    as wide as the narrowest micro-batch ``pad_multiple`` makes."""
    sizes = dict(n=9, global_batch_size=8, micro_batch_size=4, dp_size=2, pad_multiple=8)
    first, second = [loader(dp_rank=r, **sizes).all_batches() for r in range(2)]
    assert [b.input_ids.shape[0] for b in first] == [b.input_ids.shape[0] for b in second] == [4, 1]
    assert second[-1].input_ids.shape == (1, 8) and second[-1].labelled_tokens() == 0


def test_global_batch_must_divide_by_micro_batch_times_dp(loader):
    with pytest.raises(
        ValueError,
        match=r"^train.global_batch_size \(10\) must be divisible by "
        r"train.micro_batch_size \(4\) × dp \(2\)$",
    ):
        loader(global_batch_size=10, micro_batch_size=4, dp_size=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batch_size": 0}, r"train.micro_batch_size must be at least 1, got 0"),
        ({"n": 0}, r"no records to batch: the dataset \(or its validation split\) is empty"),
        ({"dp_rank": 2}, r"dp_rank \(2\) must be in 0..1 for dp \(2\)"),
    ],
)
def test_other_bad_arguments(loader, kwargs, message):
    with pytest.raises(ValueError, match=message):
        loader(**kwargs)


def test_bad_step_and_too_few_records_for_dp(loader):
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        loader().batches_for_step(-1)
    with pytest.raises(ValueError, match=r"1 records cannot be shared by dp \(2\) ranks"):
        loader(n=1).all_batches()


def test_pad_id_falls_back_to_eos():
    class EosOnly:
        pad_token_id, eos_token_id = None, 7

    class Neither:
        pad_token_id = eos_token_id = None

    assert pad_id_of(EosOnly()) == 7
    with pytest.raises(ValueError, match="tokenizer Neither has no pad or eos token"):
        pad_id_of(Neither())


def test_collate_rows_right_pads_one_example_rows_to_seq_len():
    rows = [[([1, 5, 6, 7], [-100, -100, 6, 7])], [([1, 8], [-100, 8])]]
    batch = collate_rows(rows, seq_len=6, pad_id=0)
    assert batch.input_ids.shape == batch.labels.shape == (2, 6)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 0, 0], [1, 8, 0, 0, 0, 0]]
    assert batch.labels.tolist() == [
        [-100, -100, 6, 7, -100, -100],
        [-100, 8, -100, -100, -100, -100],
    ]


def test_collate_rows_rejects_examples_longer_than_seq_len_or_with_unequal_labels():
    with pytest.raises(
        ValueError, match=r"row 0 does not fit: an example of 3 ids and 3 labels.*seq_len \(2\)"
    ):
        collate_rows([[([1, 2, 3], [1, 2, 3])]], seq_len=2, pad_id=0)
    with pytest.raises(ValueError, match=r"row 1 does not fit: an example of 2 ids and 1 labels"):
        collate_rows([[([1], [1])], [([1, 2], [1])]], seq_len=4, pad_id=0)
