"""prepare_data: tokenized once into a keyed Arrow cache, reused by the next experiment, checked in
the same pass."""

import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from components.data.collate import Labelling
from components.data.generated import generate_examples
from components.data.jsonl import DataError
from components.data.loader import StepBatches, widest_batch
from components.data.prepare import (
    data_cache_dir,
    prepare_data,
    source_cache_dir,
    split_indices,
    tokenizer_digest,
)
from components.data.sources import GeneratedSource, HFSource, JsonlSource
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer

SOURCE = GeneratedSource(num_examples=120, val_fraction=0.1, seed=2)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(SOURCE.texts(source_cache_dir(folder)), DEFAULT_VOCAB_SIZE, folder)
    return folder


def prepare(source, tokenizer_dir, root, seq_len=48, packing=False, seed=0):
    return prepare_data(
        source,
        tokenizer_dir,
        seq_len=seq_len,
        loss_on="all_assistant",
        packing=packing,
        seed=seed,
        cache_root=root,
        num_proc=1,
    )


def test_a_second_experiment_reuses_the_tokens_whatever_its_seed_or_packing(
    tokenizer_dir, tmp_path
):
    first = prepare(SOURCE, tokenizer_dir, tmp_path)
    assert not first.reused and first.train.num_examples == 108 and first.val.num_examples == 12
    for seed, packing in ((0, False), (1, False), (0, True)):
        again = prepare(SOURCE, tokenizer_dir, tmp_path, packing=packing, seed=seed)
        assert again.reused and again.folder == first.folder
    assert (
        prepare(SOURCE, tokenizer_dir, tmp_path, seq_len=40).folder != first.folder
    )  # seq_len is in the key
    leftovers = [p.name for p in data_cache_dir(tmp_path).iterdir() if ".tmp" in p.name]
    assert (
        leftovers == []
        and len(list((data_cache_dir(tmp_path) / first.folder).glob("rows-*.npz"))) == 3
    )


def test_split_and_batches_are_those_of_the_records_in_memory(tokenizer_dir, tmp_path):
    prepared = prepare(SOURCE, tokenizer_dir, tmp_path, seed=3)
    records = generate_examples(120, 2)
    train, val = ([records[i] for i in part] for part in split_indices(120, 0.1, 3))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(dp_size=2, dp_rank=1, seed=3)
    opened = StepBatches.open(prepared.train, 8, 2, **common)
    in_memory = StepBatches.from_records(
        train,
        8,
        2,
        labelling=Labelling(tokenizer=tokenizer, seq_len=48, loss_on="all_assistant"),
        **common,
    )
    for step in (0, 5, 20):  # 20 lies in the second epoch
        for a, b in zip(
            opened.batches_for_step(step), in_memory.batches_for_step(step), strict=True
        ):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert opened.labels_in_step(step) == in_memory.labels_in_step(step)
    val_opened = StepBatches.open(prepared.val, 2, 2, dp_size=1, dp_rank=0, seed=3).all_batches()
    val_memory = StepBatches.from_records(
        val,
        2,
        2,
        labelling=Labelling(tokenizer=tokenizer, seq_len=48, loss_on="all_assistant"),
        dp_size=1,
        dp_rank=0,
        seed=3,
    )
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(val_opened, val_memory.all_batches(), strict=True)
    )


def test_widest_batch_is_the_widest_micro_batch_an_epoch_of_steps_makes(tokenizer_dir, tmp_path):
    """What the dry run plans a micro-batch's positions for: with a pad multiple, the longest row
    rounded up (here shorter than seq_len); without one, seq_len."""
    prepared = prepare(SOURCE, tokenizer_dir, tmp_path)
    opened = StepBatches.open(prepared.train, 4, 2, dp_size=1, dp_rank=0, seed=0, pad_multiple=8)
    steps = range(opened.num_rows // 4 + 1)  # an epoch: every row in some micro-batch
    widths = [b.input_ids.shape[1] for step in steps for b in opened.batches_for_step(step)]
    assert widest_batch(prepared.train, 8) == max(widths) < 48
    assert widest_batch(prepared.train, None) == 48


def test_split_indices_are_seeded_disjoint_and_complete():
    train, val = split_indices(100, 0.1, seed=0)
    assert train.dtype == val.dtype == np.int64
    assert len(val) == 10 and sorted([*train, *val]) == list(range(100))
    assert train.tolist() == sorted(train) and val.tolist() == sorted(val)
    assert val.tolist() == sorted(
        random.Random(0).sample(range(100), 10)
    )  # the seeded choice, held stable
    assert [part.tolist() for part in split_indices(100, 0.1, seed=0)] == [
        train.tolist(),
        val.tolist(),
    ]
    assert split_indices(100, 0.1, seed=1)[1].tolist() != val.tolist()
    assert [part.tolist() for part in split_indices(100, 0.0, seed=0)] == [list(range(100)), []]
    assert len(split_indices(5, 0.01, seed=0)[1]) == 1  # a positive fraction holds out at least one


def test_split_indices_errors():
    with pytest.raises(ValueError, match=r"data.val_fraction must be in \[0, 1\), got 1.5"):
        split_indices(2, 1.5, seed=0)
    with pytest.raises(
        ValueError, match=r"data.val_fraction \(0.9\) of 2 records leaves none for training"
    ):
        split_indices(2, 0.9, seed=0)
    with pytest.raises(
        ValueError, match=r"data.val_fraction \(0.99\) of 50 records leaves none for training"
    ):
        split_indices(50, 0.99, seed=0)


def test_packed_rows_hold_every_training_example_once(tokenizer_dir, tmp_path):
    prepared = prepare(SOURCE, tokenizer_dir, tmp_path, packing=True)
    with np.load(prepared.train.rows_file) as rows:
        order, offsets = rows["train_order"], rows["train_offsets"]
    assert sorted(order.tolist()) == order.tolist() and len(order) == 108
    assert (
        offsets[0] == 0
        and offsets[-1] == 108
        and prepared.train.num_rows == len(offsets) - 1 < 108 / 3
    )


def _jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_a_record_without_answer_tokens_is_named_and_nothing_is_cached(tokenizer_dir, tmp_path):
    records = generate_examples(6, 0)
    records[3] = {"prompt": "a very long prompt " * 20, "response": "x"}
    path = str(_jsonl(tmp_path / "data.jsonl", records))
    source = JsonlSource(path=path, num_examples=None, val_fraction=0.0)
    with pytest.raises(DataError) as caught:
        prepare(source, tokenizer_dir, tmp_path / "cache", seq_len=16)
    shorten = "raise train.seq_len or shorten its prompt"
    assert (
        str(caught.value) == f"record 4 has no answer tokens within train.seq_len (16): {shorten}"
    )
    assert [
        p.name for p in data_cache_dir(tmp_path / "cache").iterdir() if p.name != "sources"
    ] == []


def test_a_malformed_record_of_a_dataset_is_named_by_index(tokenizer_dir, tmp_path):
    rows = [{"q": "Add 1 and 2", "a": "3"}, {"q": "Add 2 and 2", "a": None}]
    source = HFSource(
        path=str(_jsonl(tmp_path / "d.jsonl", rows)),
        split="train",
        name=None,
        columns={"prompt": "q", "response": "a"},
        num_examples=None,
        val_fraction=0.0,
    )
    with pytest.raises(DataError) as caught:
        prepare(source, tokenizer_dir, tmp_path / "cache")
    assert str(caught.value) == 'record 2: needs "prompt" and "response" strings, or "messages"'


def test_a_bad_jsonl_line_keeps_its_message_and_an_edited_file_is_tokenized_again(
    tokenizer_dir, tmp_path
):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"\n')
    source = JsonlSource(path=str(path), num_examples=None, val_fraction=0.0)
    with pytest.raises(
        DataError, match=r"data.jsonl line 2: not valid JSON \(Expecting ',' delimiter\)$"
    ):
        prepare(source, tokenizer_dir, tmp_path / "cache")
    _jsonl(path, generate_examples(10, 0))
    first = prepare(source, tokenizer_dir, tmp_path / "cache")
    _jsonl(path, generate_examples(11, 0))
    second = prepare(source, tokenizer_dir, tmp_path / "cache")
    assert not second.reused and second.folder != first.folder and second.train.num_examples == 11


def test_a_tokenizer_without_a_chat_template_is_one_line(tokenizer_dir, tmp_path):
    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    for leftover in (tmp_path / "plain").glob("chat_template*"):
        leftover.unlink()
    with pytest.raises(DataError, match=r"^tokenizer \w+ has no chat_template: use one that has"):
        prepare(SOURCE, tmp_path / "plain", tmp_path / "cache")


def test_the_tokenizer_digest_follows_the_special_tokens_a_chat_template_renders(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer_digest(tokenizer) == tokenizer_digest(
        AutoTokenizer.from_pretrained(tokenizer_dir)
    )
    renamed = AutoTokenizer.from_pretrained(tokenizer_dir)
    renamed.bos_token = (
        "<|begin|>"  # same vocabulary, merges and ids: only the string a template would print
    )
    assert tokenizer_digest(renamed) != tokenizer_digest(tokenizer)


def test_a_file_rewritten_with_the_same_size_and_mtime_is_tokenized_again(tokenizer_dir, tmp_path):
    path = tmp_path / "data.jsonl"
    records = [{"prompt": f"Add {i} and 1", "response": str(i + 1)} for i in range(10)]
    _jsonl(path, records)
    source = JsonlSource(path=str(path), num_examples=None, val_fraction=0.0)
    first = prepare(source, tokenizer_dir, tmp_path / "cache")
    stat = path.stat()
    swapped = [{"prompt": f"Add {i} and 2", "response": str(i + 1)} for i in range(10)]
    _jsonl(path, swapped)  # one digit per record: the same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime (cp -p, touch -r)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    second = prepare(source, tokenizer_dir, tmp_path / "cache")
    assert not second.reused and second.folder != first.folder
    os.utime(path)  # touched only: the same bytes, so the same tokens
    assert prepare(source, tokenizer_dir, tmp_path / "cache").folder == second.folder


def test_a_tampered_split_is_detected_and_written_again(tokenizer_dir, tmp_path):
    first = prepare(SOURCE, tokenizer_dir, tmp_path)
    rows_file = Path(first.train.rows_file)
    arrays = dict(np.load(rows_file))
    for name, keep in (("order", 1), ("offsets", 2), ("tokens", 1), ("labelled", 1)):
        arrays[f"train_{name}"] = arrays[f"train_{name}"][:keep]  # one record left to train on
    np.savez(rows_file, **arrays)
    again = prepare(SOURCE, tokenizer_dir, tmp_path)
    assert again.reused and again.train.num_examples == 108 and again.train.num_rows == 108
    assert "its train split holds 1 records, not the 108" in again.repaired
    assert prepare(SOURCE, tokenizer_dir, tmp_path).repaired is None


@pytest.mark.parametrize("damage", ["meta.json", "truncated tokens", "another count"])
def test_damaged_cached_tokens_are_tokenized_again(tokenizer_dir, tmp_path, damage):
    first = prepare(SOURCE, tokenizer_dir, tmp_path)
    folder = Path(first.folder)
    if damage == "meta.json":
        (folder / "meta.json").write_text("garbage")
    elif damage == "truncated tokens":
        arrow = next((folder / "tokens").glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:1000])
    else:
        (folder / "meta.json").write_text(json.dumps({"num_examples": 1, "seq_len": 48}))
    again = prepare(SOURCE, tokenizer_dir, tmp_path)
    assert not again.reused and again.repaired.startswith(f"the cached tokens in {folder}")
    assert again.train.num_examples == 108 and again.val.num_examples == 12


def test_a_cache_that_cannot_be_written_is_one_line(tokenizer_dir, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(DataError, match=r"the cache folder .*a_file/data cannot be written \(Not"):
        prepare(SOURCE, tokenizer_dir, tmp_path / "a_file")


class _InterruptedSource:
    """A source whose records are being read when Ctrl-C arrives, as map's pool reports it: its own
    TimeoutError raised while handling the KeyboardInterrupt."""

    num_examples, val_fraction = None, 0.0

    def fingerprint(self) -> str:
        return "interrupted"

    def load(self, cache_dir):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise TimeoutError from None  # the pool's, with the interrupt as its context


def test_ctrl_c_while_tokenizing_is_an_interrupt_and_leaves_no_scratch(tokenizer_dir, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        prepare(_InterruptedSource(), tokenizer_dir, tmp_path)
    assert [p.name for p in data_cache_dir(tmp_path).iterdir() if ".tmp" in p.name] == []


def test_map_workers_leave_ctrl_c_to_the_launcher():
    from components.data import prepare as module

    module._MAPPING[:] = [os.getpid()]
    try:
        child = os.fork()
        if child == 0:  # a map worker: SIGINT ignored, so it prints no traceback of its own
            os._exit(0 if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 1)
    finally:
        module._MAPPING.clear()
    assert os.waitpid(child, 0)[1] == 0
