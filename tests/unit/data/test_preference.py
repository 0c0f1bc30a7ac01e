"""Preference records: each a chosen and a rejected conversation whose labels are the answer's
tokens as SFT labels them, prepared into the cache in pairs that the split and the batches keep
together; a record without its answers is one line naming it."""

import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from components.data.collate import IGNORE_INDEX, tokenize_example
from components.data.jsonl import DataError
from components.data.loader import open_splits, widest_batch
from components.data.preference import iter_pairs, pair_conversations, preference_problem
from components.data.sources import (
    EmbeddedPreferenceSource,
    JsonlSource,
    PreferenceHFSource,
    preference_source,
)
from tests.unit.data.test_prepare import prepare, tokenizer_dir  # noqa: F401 - the fixture

EMBEDDED = EmbeddedPreferenceSource(num_examples=30, val_fraction=0.1, seed=3)


def test_the_three_record_shapes_make_the_same_two_conversations():
    user = [{"role": "user", "content": "Add 1 and 2"}]
    answers = {"chosen": "3", "rejected": "4"}
    strings = {"prompt": "Add 1 and 2", **answers}
    turns = {name: [{"role": "assistant", "content": text}] for name, text in answers.items()}
    implicit = {name: user + turns[name] for name in answers}
    conversational = {"prompt": user, **turns}
    expected = pair_conversations(strings)
    assert expected == (implicit["chosen"], implicit["rejected"])
    for record in (strings, implicit, conversational):
        assert preference_problem(record) is None
        assert pair_conversations(record) == expected


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"prompt": "a", "response": "b"}, 'needs "chosen" and "rejected" (missing chosen and'),
        ({"prompt": "a", "chosen": "b"}, "(missing rejected;"),
        ({"chosen": "b", "rejected": "c"}, 'string "chosen" and "rejected" answers need a'),
        ({"prompt": "a", "chosen": 3, "rejected": "c"}, '"chosen" must be a string or a'),
    ],
)
def test_a_record_without_its_answers_is_named(record, says):
    assert says in preference_problem(record)


def test_implicit_prompts_must_agree():
    record = {
        "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "c"}],
    }
    assert "must answer the same messages" in preference_problem(record)


def test_a_pair_of_the_same_answer_twice_is_named():
    """Its loss would sit at log 2 with no gradient: not a preference."""
    same = "the same answer: a pair prefers one of two answers"
    assert same in preference_problem({"prompt": "a", "chosen": "b", "rejected": "b"})
    asked = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert same in preference_problem({"chosen": asked, "rejected": list(asked)})


def test_the_embedded_pairs_have_a_wrong_answer_rejected():
    pairs = list(iter_pairs(50, seed=0))
    assert len(pairs) == 50 and all(p["chosen"] != p["rejected"] for p in pairs)
    assert pairs == list(iter_pairs(50, seed=0))


def test_prepared_pairs_stay_together_and_batch_chosen_then_rejected(tokenizer_dir, tmp_path):  # noqa: F811
    prepared = prepare(EMBEDDED, tokenizer_dir, tmp_path, seq_len=48)
    assert prepared.train.pairs and prepared.train.num_rows == 27 and prepared.val.num_rows == 3
    assert prepared.train.num_examples == 54
    train, _ = open_splits(prepared.train, prepared.val, 4, 2, dp_size=1, dp_rank=0, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pairs = []
    for record in iter_pairs(30, seed=3):
        made = [
            tokenize_example({"messages": m}, tokenizer, 48, "all_assistant")
            for m in pair_conversations(record)
        ]
        pairs.append([(ids, [IGNORE_INDEX, *labels[1:]]) for ids, labels in made])
    batches = train.batches_for_step(0)
    labelled = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    assert len(batches) == 2 and train.labels_in_step(0) == labelled
    for batch in batches:
        assert batch.input_ids.shape == (4, 48)  # 2 pairs: chosen, chosen, rejected, rejected
        rows = [
            (batch.input_ids[row, :n].tolist(), batch.labels[row, :n].tolist())
            for row, n in enumerate(batch.real_tokens.tolist())
        ]
        for pair in range(2):
            assert [rows[pair], rows[pair + 2]] in pairs


def test_two_dp_ranks_share_every_pair_once_and_one_padding_pair(tokenizer_dir, tmp_path):  # noqa: F811
    """The 3 held-out pairs at dp=2: rank 0 the first two, rank 1 the third and a padding pair,
    two rows of no tokens and no labels in the places of a chosen and a rejected conversation."""
    prepared = prepare(EMBEDDED, tokenizer_dir, tmp_path, seq_len=48)
    shards = dict(dp_size=1, dp_rank=0, seed=0)
    (whole,) = open_splits(prepared.train, prepared.val, 3, 3, **shards)[1].all_batches()
    shares = []
    for rank in range(2):
        shards = dict(dp_size=2, dp_rank=rank, seed=0)
        shares += open_splits(prepared.train, prepared.val, 4, 2, **shards)[1].all_batches()
    first, second = (batch.input_ids for batch in shares)
    assert torch.equal(first, whole.input_ids[[0, 1, 3, 4]])
    assert torch.equal(second[[0, 2]], whole.input_ids[[2, 5]])
    assert (second[[1, 3]] == prepared.val.pad_id).all()
    assert (shares[1].labels[[1, 3]] == IGNORE_INDEX).all()
    assert sum(b.labelled_tokens() for b in shares) == whole.labelled_tokens()


def test_a_jsonl_record_without_rejected_is_one_line_naming_it(tokenizer_dir, tmp_path):  # noqa: F811
    path = tmp_path / "pairs.jsonl"
    lines = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = preference_source(JsonlSource(path=str(path), num_examples=None, val_fraction=0.0))
    with pytest.raises(DataError, match=r"pairs.jsonl line 2: a preference record needs "):
        prepare(source, tokenizer_dir, tmp_path / "cache")


def test_sft_data_is_refused_as_preference_pairs():
    from components.data.sources import GeneratedSource

    with pytest.raises(DataError, match=r"^data=default is not read as preference pairs: use "):
        preference_source(GeneratedSource(num_examples=4, val_fraction=0.0, seed=0))


def test_the_widest_batch_of_pairs_is_the_longest_conversation_padded(tokenizer_dir, tmp_path):  # noqa: F811
    """What the dry run plans DPO's micro-batch positions for: the widest micro-batch the loader
    pads, every pair alone in one (its chosen and rejected rows padded to the longer), not the
    two conversations' tokens together."""
    prepared = prepare(EMBEDDED, tokenizer_dir, tmp_path, seq_len=48)
    shards = dict(dp_size=1, dp_rank=0, seed=0, pad_multiple=8)
    train, _ = open_splits(prepared.train, prepared.val, 1, 1, **shards)
    widths = [batch.input_ids.shape[1] for batch in train.all_batches()]
    assert len(widths) == 27 and widest_batch(prepared.train, 8) == max(widths) < 48
    assert widest_batch(prepared.train, None) == 48  # no pad multiple: every row seq_len long


def hf_pairs(path, columns=None, num_examples=None) -> PreferenceHFSource:
    return PreferenceHFSource(
        path=str(path), split="train", name=None, columns=columns, num_examples=num_examples,
        val_fraction=0.0,
    )  # fmt: skip


PAIRS = [
    {"prompt": "Add 38 and 27.", "chosen": "65.", "rejected": "68."},
    {"prompt": "Add 8 and 29.", "chosen": "37.", "rejected": "40."},
    {"prompt": "Add 44 and 16.", "chosen": "60.", "rejected": "63."},
]


def test_a_datasets_split_of_pairs_is_read_as_the_jsonl_files_pairs(tmp_path):
    """A save_to_disk folder with its own column names (data.columns), the first two records
    (data.num_examples): the conversations the JSONL file of those records makes."""
    renamed = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS]
    datasets.Dataset.from_list(renamed).save_to_disk(tmp_path / "saved")
    columns = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    ours = hf_pairs(tmp_path / "saved", columns, num_examples=2).load(tmp_path / "cache")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in PAIRS))
    jsonl = preference_source(JsonlSource(path=str(path), num_examples=2, val_fraction=0.0))
    assert ours["messages"] == jsonl.load(tmp_path / "cache")["messages"]
    assert len(ours) == 4 and ours[1]["messages"][-1] == {"role": "assistant", "content": "68."}


def test_a_record_of_a_datasets_split_without_an_answer_is_named(tmp_path):
    """datasets reads the answer a record lacks as None: missing, as in a JSONL file."""
    path = tmp_path / "pairs.jsonl"
    lines = [PAIRS[0], {"prompt": "a", "chosen": "b"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DataError) as refused:
        hf_pairs(path).load(tmp_path / "cache")
    assert str(refused.value) == (
        f'{path} record 2: a preference record needs "chosen" and "rejected" (missing rejected; '
        "its keys: 'chosen', 'prompt')"
    )


def test_a_column_mapping_onto_other_names_than_a_pairs_is_one_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in PAIRS))
    with pytest.raises(DataError) as refused:
        hf_pairs(path, {"prompt": "prompt", "response": "chosen"}).load(tmp_path / "cache")
    assert str(refused.value) == (
        "data.columns maps prompt, response: map exactly chosen and rejected (and prompt), onto "
        f"columns of {path} (prompt, chosen, rejected)"
    )
