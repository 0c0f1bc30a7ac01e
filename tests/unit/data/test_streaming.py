"""data.streaming: a streamed epoch's rows are the cached path's rows (same order, same tokens), a
position resumes the rows exactly, and dp ranks read distinct records."""

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from components.data.checks import checked_source
from components.data.collate import Labelling
from components.data.generated import generate_examples
from components.data.jsonl import DataError
from components.data.loader import open_tokens, pad_id_of
from components.data.packing import Rows
from components.data.prepare import prepare_data
from components.data.sources import GeneratedSource, HFSource
from components.data.streaming import (
    RowMaking,
    StreamBatches,
    StreamedSource,
    StreamedSplit,
    StreamPosition,
    check_dp_parts,
    example_of,
    stream_rows,
)
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from recipes.compose import compose, mix_kinds
from recipes.validate import validate

SEQ_LEN = 64


def row_making(tokenizer_dir, packing: bool) -> RowMaking:
    """Rows of :data:`SEQ_LEN` tokens labelled on every assistant turn, by the tokenizer in
    ``tokenizer_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return RowMaking(
        tokenizer_dir=str(tokenizer_dir),
        seq_len=SEQ_LEN,
        loss_on="all_assistant",
        packing=packing,
        pad_id=pad_id_of(tokenizer),
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    texts = GeneratedSource(num_examples=120, val_fraction=0.0, seed=2).texts(folder)
    train_tokenizer(texts, DEFAULT_VOCAB_SIZE, folder)
    return folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three Parquet shards of 30 distinct records in all, in small row groups."""
    folder = tmp_path_factory.mktemp("shards")
    records = [
        {"prompt": f"{index}. {record['prompt']}", "response": record["response"]}
        for index, record in enumerate(generate_examples(30, seed=5))
    ]
    for shard in range(3):
        part = records[shard * 10 : (shard + 1) * 10]
        table = pa.table({key: [record[key] for record in part] for key in ("prompt", "response")})
        pq.write_table(table, folder / f"part-{shard}.parquet", row_group_size=4)
    return folder


def streamed(path, tokenizer_dir, packing, dp=(1, 0), position=None):
    source = StreamedSource(path=str(path), split="train", name=None, columns=(), num_examples=None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    labelling = Labelling(tokenizer=tokenizer, seq_len=SEQ_LEN, loss_on="all_assistant")

    def open_epoch(epoch):
        stream = source.open(dp_size=dp[0], dp_rank=dp[1])
        stream.set_epoch(epoch)
        return stream

    return stream_rows(position or StreamPosition(), open_epoch, labelling, packing)


def first_epoch(rows):
    taken = []
    for row, position in rows:
        taken.append((row, position))
        if position.epoch == 1:
            return taken
    raise AssertionError("the stream ended")


def cached_rows(path, tokenizer_dir, root, packing):
    where = dict(path=str(path), split="train", name=None, columns=None)
    source = HFSource(**where, num_examples=None, val_fraction=0.0)
    labels = dict(seq_len=SEQ_LEN, loss_on="all_assistant", packing=packing, seed=0)
    prepared = prepare_data(source, tokenizer_dir, **labels, cache_root=root, num_proc=1)
    tokens = open_tokens(prepared.train.tokens_dir)
    with np.load(prepared.train.rows_file) as arrays:
        rows = Rows.load_from(arrays, "train")
    assert np.array_equal(rows.order, np.arange(30))  # nothing held out, in the file's order
    spans = zip(rows.offsets[:-1], rows.offsets[1:], strict=True)
    return [
        [(tokens[int(i)]["input_ids"], tokens[int(i)]["labels"]) for i in rows.order[a:b]]
        for a, b in spans
    ]


@pytest.mark.parametrize("packing", [True, False])
def test_a_streamed_epoch_is_the_cached_rows_in_order(shards, tokenizer_dir, tmp_path, packing):
    rows = [row for row, _ in first_epoch(streamed(shards, tokenizer_dir, packing))]
    cached = cached_rows(shards, tokenizer_dir, tmp_path, packing)
    assert [[(ids, labels) for ids, labels, _ in row] for row in rows] == cached
    assert len(cached) < 30 if packing else len(cached) == 30  # packed: rows of several


def test_a_position_resumes_the_rows_exactly(shards, tokenizer_dir):
    whole = list(itertools.islice(streamed(shards, tokenizer_dir, True), 40))  # over 2 epochs
    for stop in (3, len(first_epoch(streamed(shards, tokenizer_dir, True))), 25):
        position = StreamPosition.of_json(whole[stop - 1][1].as_json())
        again = itertools.islice(streamed(shards, tokenizer_dir, True, position=position), 10)
        assert [row for row, _ in again] == [row for row, _ in whole[stop : stop + 10]]


def test_dp_ranks_read_distinct_records_that_cover_the_stream(shards, tokenizer_dir):
    def ids(dp):
        rows = first_epoch(streamed(shards, tokenizer_dir, False, dp=dp))
        return [tuple(row[0][0]) for row, _ in rows]

    whole, first, second = ids((1, 0)), ids((2, 0)), ids((2, 1))
    assert len(set(whole)) == 30 and not set(first) & set(second)
    assert sorted(first + second) == sorted(whole)


def streaming_problems(*overrides: str) -> list[str]:
    """The problems of ``data.streaming=true`` with ``overrides``, as the checks find them."""
    settings = validate(compose(["data.streaming=true", *overrides]))
    found = settings.data.streaming_errors(settings.train.val_every)
    data = settings.data.model_dump(by_alias=True)
    found += [problem.message for problem in checked_source(data, False, mix_kinds(0))[1]]
    return found


def test_what_cannot_stream_is_one_line_each(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"prompt": "a", "response": "b"}\n')
    fix = "use data=hf data.path=FILE_FOLDER_OR_HUB_ID, or data.streaming=false"
    only = "only a datasets source is streamed, not data=jsonl's file or data=default's set"
    mix = "data=mix", "data.val_fraction=0", "train.val_every=0"
    given = f"[{{name:a,weight:1,kind:generated}},{{name:b,weight:1,kind:jsonl,path:{chats}}}]"
    fix_kind = "give kind:hf,path:FILE_FOLDER_OR_HUB_ID, or data.streaming=false"
    assert streaming_problems(*mix, f"data.sources={given}") == [
        f"data.sources[0] (a): kind generated is not streamed: {fix_kind}",
        f"data.sources[1] (b): kind jsonl is not streamed: {fix_kind}",
    ]
    held = f"[{{name:a,weight:1,kind:hf,path:{chats},val_fraction:0.1}}]"
    assert streaming_problems(*mix, f"data.sources={held}") == [
        "data.sources[0] (a): val_fraction=0.1: a stream holds nothing out: set it to 0 or leave "
        "it out"
    ]
    streamed = f"data.sources=[{{name:a,weight:1,kind:hf,path:{chats}}}]"
    assert streaming_problems("data=mix", streamed, "train.val_every=0") == [
        "data.streaming=true holds out no validation split (a stream's size is not known before "
        "it is read): set data.val_fraction=0"
    ]
    assert streaming_problems(*mix, streamed) == []
    assert streaming_problems("data=jsonl", f"data.path={chats}", "train.val_every=0") == [
        f"data.streaming=true: {only}: {fix}"
    ]
    assert streaming_problems("train.val_every=0", "data.val_fraction=0") == [
        f"data.streaming=true: {only}: {fix}"
    ]
    assert streaming_problems("data=hf", f"data.path={chats}") == [
        "data.streaming=true holds out no validation split (a stream's size is not known before "
        "it is read): set data.val_fraction=0 and train.val_every=0"
    ]
    assert streaming_problems("data=hf", f"data.path={chats}", "data.val_fraction=0") == [
        "data.streaming=true holds out no validation split (a stream's size is not known before "
        "it is read): set train.val_every=0"
    ]
    ok = "data=hf", f"data.path={chats}", "data.val_fraction=0", "train.val_every=0"
    assert streaming_problems(*ok) == []


def test_a_stream_that_cannot_be_read_is_refused_before_any_rank(shards, tokenizer_dir, tmp_path):
    def refusal(path, columns=(), **written):
        for name, text in written.items():
            (tmp_path / name).write_text(text)
        source = StreamedSource(
            path=str(path), split="train", name=None, columns=columns, num_examples=None
        )
        options = dict(seq_len=SEQ_LEN, loss_on="all_assistant", packing=True, seed=0)
        with pytest.raises(DataError) as raised:
            prepare_data(source, tokenizer_dir, **options, cache_root=tmp_path, num_proc=1)
        return str(raised.value)

    assert refusal(tmp_path / "a.txt", **{"a.txt": "x"}) == (
        f"data.path='{tmp_path / 'a.txt'}' has suffix '.txt': use .arrow, .csv, .json, .jsonl, "
        ".parquet"
    )
    assert refusal(shards, columns=(("prompt", "q"), ("response", "a"))) == (
        f"data.columns prompt='q', response='a': no such column in {shards}; its columns are "
        "prompt, response"
    )
    empty = refusal(tmp_path / "e.jsonl", **{"e.jsonl": ""})
    assert empty == f"data.path='{tmp_path / 'e.jsonl'}' has no records"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    empty = refusal(tmp_path / "e.parquet")  # pyarrow: "BatchSize must be greater than 0"
    assert empty == f"data.path='{tmp_path / 'e.parquet'}' has no records"
    user_last = '{"messages": [{"role": "user", "content": "a"}]}\n'
    assert refusal(tmp_path / "b.jsonl", **{"b.jsonl": user_last}) == (
        "the stream's record 1: the last message must be from the assistant (it is from the user)"
    )


def test_a_worker_reads_the_steps_and_names_a_bad_record_in_one_line(tokenizer_dir, tmp_path):
    """StreamBatches at dp=1: each step's micro-batches hold the next rows of the stream, and a
    record the worker cannot train on stops the rank with its one line."""
    records = [{"prompt": f"Add {i} and 1", "response": str(i + 1)} for i in range(12)]
    records[9] = {"prompt": "Add 9 and 1", "response": None}
    table = pa.table({key: [record[key] for record in records] for key in ("prompt", "response")})
    pq.write_table(table, tmp_path / "bad.parquet")
    source = StreamedSource(
        path=str(tmp_path / "bad.parquet"), split="train", name=None, columns=(), num_examples=None
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    split = StreamedSplit(source=source, making=row_making(tokenizer_dir, packing=False))
    loader = StreamBatches(split, 4, 2, dp_size=1, dp_rank=0, group=None)
    labelling = Labelling(tokenizer=tokenizer, seq_len=SEQ_LEN, loss_on="all_assistant")
    examples = [example_of(record, labelling, index) for index, record in enumerate(records[:8])]
    for step in (0, 1):
        batches = loader.batches_for_step(step)
        assert len(batches) == loader.micro_batches_per_step == 2
        expected = examples[step * 4 : step * 4 + 4]
        ids = [
            row[: int(n)].tolist()
            for b in batches
            for row, n in zip(b.input_ids, b.real_tokens, strict=True)
        ]
        assert ids == [example[0] for example in expected]
        assert loader.labels_in_step(step) == sum(example[2] for example in expected)
        assert loader.tokens_in_step(step) == sum(len(example[0]) for example in expected)
    assert StreamPosition.of_json(loader.state_dict()["positions"][0]).records == 9
    with pytest.raises(DataError) as raised:
        loader.batches_for_step(2)
    assert str(raised.value) == (
        'the stream\'s record 10: needs "prompt" and "response" strings, or "messages"'
    )


def test_a_stream_with_fewer_records_than_dp_ranks_is_refused_before_any_rank(tmp_path):
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    record = json.dumps({"messages": turns})
    (tmp_path / "one.jsonl").write_text(record + "\n")
    (tmp_path / "two.jsonl").write_text(record + "\n" + record + "\n")

    def source(name: str) -> StreamedSource:
        path = str(tmp_path / name)
        return StreamedSource(path=path, split="train", name=None, columns=(), num_examples=None)

    check_dp_parts((source("two.jsonl"),), 2)  # one record a rank: it trains
    with pytest.raises(DataError) as raised:
        check_dp_parts((source("two.jsonl"), source("one.jsonl")), 2)
    assert str(raised.value) == (
        f"data.path='{tmp_path / 'one.jsonl'}' holds too few records for dp=2: dp rank 1's part "
        "of the stream has none; use fewer dp ranks or more records"
    )
