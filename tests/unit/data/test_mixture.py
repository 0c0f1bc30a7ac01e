"""data=mix: the stride-scheduled interleave keeps each source's share over every window, is a
function of the position alone, and the prepared mixture's batches are the same at any dp; its
sources are checked one problem a line."""

import random

import numpy as np
import pytest
import torch

from components.data.checks import checked_source
from components.data.jsonl import DataError
from components.data.loader import StepBatches
from components.data.mixture import integer_weights, interleave
from components.data.prepare import prepare_data, source_cache_dir
from components.data.sources import GeneratedSource, HFSource, JsonlSource, MixPart, MixSource
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer

WEIGHTS = [0.6, 0.3, 0.1]


def shares(sources: list[int], count: int) -> list[float]:
    return [sources.count(source) / len(sources) for source in range(count)]


def test_shares_hold_over_the_first_1000_rows_and_over_every_window_of_100():
    sources = [source for source, _ in interleave(integer_weights(WEIGHTS), 0, 1000)]
    for share, weight in zip(shares(sources, 3), WEIGHTS, strict=True):
        assert abs(share - weight) <= 0.02
    for start in range(len(sources) - 100 + 1):
        window = shares(sources[start : start + 100], 3)
        assert all(abs(s - w) <= 0.05 for s, w in zip(window, WEIGHTS, strict=True)), start


@pytest.mark.parametrize("weights", [WEIGHTS, [1, 1, 2], [0.5, 0.0, 0.5], [1 / 3, 2 / 3]])
def test_any_range_of_positions_is_that_of_the_whole_stream(weights):
    scaled = integer_weights(weights)
    whole = interleave(scaled, 0, 2000)
    rng = random.Random(0)
    for start in [0, 1, 2, 3, *rng.sample(range(1950), 40)]:
        assert interleave(scaled, start, 50) == whole[start : start + 50], start
    for source, weight in enumerate(scaled):  # each source's rows in order, none skipped
        taken = [k for s, k in whole if s == source]
        assert taken == list(range(len(taken))) and (weight > 0) == bool(taken)


@pytest.mark.parametrize("weights", [[0.5, -0.1], [0.0, 0.0], [float("nan"), 1.0]])
def test_weights_that_share_nothing_are_refused(weights):
    with pytest.raises(ValueError, match="mixture weights must be >= 0, finite and not all zero"):
        integer_weights(weights)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three generated sources of 60, 30 and 12 records (the last recycled within a few steps)."""
    root = tmp_path_factory.mktemp("mixture")
    sizes = [60, 30, 12]
    parts = tuple(
        MixPart(
            name=name,
            weight=weight,
            source=GeneratedSource(num_examples=n, val_fraction=0.2, seed=i),
        )
        for i, (name, weight, n) in enumerate(
            zip(["big", "mid", "small"], WEIGHTS, sizes, strict=True)
        )
    )
    mix = MixSource(parts=parts, num_examples=None, val_fraction=0.2)
    tokenizer_dir = root / "tokenizer"
    train_tokenizer(mix.texts(source_cache_dir(root)), DEFAULT_VOCAB_SIZE, tokenizer_dir)
    options = dict(seq_len=48, loss_on="all_assistant", packing=False, seed=3)
    return prepare_data(mix, tokenizer_dir, **options, cache_root=root, num_proc=1)


def test_each_source_keeps_its_own_validation_split(prepared):
    assert list(prepared.val_sources) == ["big", "mid", "small"]
    assert [split.num_rows for split in prepared.val_sources.values()] == [12, 6, 2]
    assert [split.num_rows for split in prepared.train.parts] == [48, 24, 10]
    assert prepared.val.num_rows == 20


def _step_rows(split, dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's input_ids and labels, every dp rank's micro-batches in rank order."""
    batches = [
        batch
        for rank in range(dp)
        for batch in StepBatches.open(
            split, 8, 2, dp_size=dp, dp_rank=rank, seed=3
        ).batches_for_step(step)
    ]
    return torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches])


def test_a_resume_at_another_dp_reads_the_uninterrupted_runs_batches(prepared):
    # uninterrupted at dp=2; resumed at step 5 at dp=1 and at dp=4: the same tokens at every step
    for step in range(5, 12):  # the small source (10 rows, ~0.8 a step) is recycled by step 12
        ids, labels = _step_rows(prepared.train, 2, step)
        for dp in (1, 4):
            again_ids, again_labels = _step_rows(prepared.train, dp, step)
            assert torch.equal(ids, again_ids) and torch.equal(labels, again_labels)


def test_rows_come_from_the_sources_in_the_interleaves_order_and_run_out_into_a_new_epoch(prepared):
    loader = StepBatches.open(prepared.train, 8, 8, dp_size=1, dp_rank=0, seed=3)
    rows = [row for step in range(125) for row in loader.indices_for_step(step)]  # 1,000 rows
    firsts = np.array([0, 48, 72])
    sources = [int(np.searchsorted(firsts, row, side="right")) - 1 for row in rows]
    assert sources == loader.mixture.sources(0, 1000)
    for source, weight in enumerate(WEIGHTS):
        assert abs(sources.count(source) / 1000 - weight) <= 0.02
    small = [row - 72 for row, source in zip(rows, sources, strict=True) if source == 2]
    for epoch in range(len(small) // 10):  # each epoch of the small source: its 10 rows once
        assert sorted(small[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert small[:10] != small[10:20]  # reshuffled each epoch


KINDS = {
    "generated": {
        "_target_": "components.data.sources.GeneratedSource",
        "num_examples": 4000,
        "val_fraction": 0.02,
        "seed": 0,
    },
    "jsonl": {
        "_target_": "components.data.sources.JsonlSource",
        "path": "???",
        "num_examples": None,
        "val_fraction": 0.05,
    },
}
MIX = {
    "_target_": "components.data.sources.MixSource",
    "num_examples": None,
    "val_fraction": 0.1,
    "loss_on": "all_assistant",
}


def test_a_mixtures_sources_take_their_kinds_keys_and_the_mixtures_val_fraction(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n')
    sources = [
        {"name": "mine", "weight": 0.7, "kind": "jsonl", "path": str(path)},
        {
            "name": "demo",
            "weight": 0.3,
            "kind": "generated",
            "num_examples": 50,
            "val_fraction": 0.0,
        },
    ]
    mix, found = checked_source({**MIX, "sources": sources}, False, KINDS)
    assert found == []
    assert mix.parts == (
        MixPart(
            name="mine",
            weight=0.7,
            source=JsonlSource(path=str(path), num_examples=None, val_fraction=0.1),
        ),
        MixPart(
            name="demo",
            weight=0.3,
            source=GeneratedSource(num_examples=50, val_fraction=0.0, seed=0),
        ),
    )


def test_every_bad_source_is_a_problem_of_its_own():
    sources = [
        {"name": "a", "weight": -1, "kind": "generated"},
        {"name": "b", "weight": 1, "kind": "parquet"},
        {"name": "c", "weight": 1, "kind": "jsonl"},
        {"name": "d", "weight": 1, "kind": "generated", "colour": "red"},
        {"name": "d", "weight": 1, "kind": "generated"},
    ]
    mix, found = checked_source({**MIX, "sources": sources}, False, KINDS)
    assert mix is None and {problem.key for problem in found} == {"data.sources"}
    assert [problem.message for problem in found] == [
        "data.sources[0].weight=-1: give a number >= 0 (a share of the rows)",
        "data.sources[1].kind='parquet': use one of generated, jsonl",
        "data.sources[2] (c): kind jsonl needs path, e.g. {name:c,kind:jsonl,path:...}",
        "data.sources[3] (d): colour is not a key of GeneratedSource",
    ]
    zero = [{"name": n, "weight": 0, "kind": "generated"} for n in ("a", "b")]
    twice = [{"name": "a", "weight": 1, "kind": "generated"}] * 2
    assert [p.message for p in checked_source({**MIX, "sources": zero}, False, KINDS)[1]] == [
        "data.sources: every weight is 0: give one a positive weight"
    ]
    assert [p.message for p in checked_source({**MIX, "sources": twice}, False, KINDS)[1]] == [
        "data.sources: 'a' names 2 sources: name each once"
    ]
    assert checked_source({**MIX, "sources": []}, False, KINDS)[1][0].message.startswith(
        "data.sources=[] is not a list of sources: use e.g. data.sources='[{name:mine,"
    )


def test_a_sources_failure_in_preparation_is_named_as_that_source(tmp_path):
    """What a source says of its data (an empty file, a column it lacks) names its place in the
    mixture and its own keys, not the top ``data.*``: while the tokenizer reads its texts and
    while its rows are prepared."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    generated = GeneratedSource(num_examples=8, val_fraction=0.0, seed=0)
    demo = MixPart(name="demo", weight=1.0, source=generated)
    hf = dict(split="train", name=None, columns=None, num_examples=None, val_fraction=0.0)
    mine = MixPart(name="mine", weight=1.0, source=HFSource(path=str(empty), **hf))
    mix = MixSource(parts=(demo, mine), num_examples=None, val_fraction=0.0)
    with pytest.raises(DataError) as raised:
        list(mix.texts(source_cache_dir(tmp_path)))
    assert str(raised.value) == f"data.sources[1] (mine): path={str(empty)!r} has no records"
    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer(generated.texts(source_cache_dir(tmp_path)), DEFAULT_VOCAB_SIZE, tokenizer_dir)
    options = dict(seq_len=48, loss_on="all_assistant", packing=False, seed=3)
    with pytest.raises(DataError) as raised:
        prepare_data(mix, tokenizer_dir, **options, cache_root=tmp_path, num_proc=1)
    assert str(raised.value) == f"data.sources[1] (mine): path={str(empty)!r} has no records"
