"""data=mix data.streaming=true: a streamed mixture's rows are the cached mixture's interleave over
the sources' streamed rows, its shares hold, its dp ranks split each step as the cached mixture's,
and a saved position resumes the rows exactly."""

import itertools
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from components.data.collate import Labelling
from components.data.generated import generate_examples
from components.data.mixture import integer_weights, interleave
from components.data.stream_mixture import MixPosition, StreamedMixSplit
from components.data.streaming import StreamedSource, StreamedSplit, StreamPosition
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.unit.data.test_streaming import row_making

SEQ_LEN = 64
WEIGHTS = (0.6, 0.3, 0.1)
NAMES = ("big", "mid", "small")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    texts = (f"{r['prompt']} {r['response']}" for r in generate_examples(120, seed=2))
    train_tokenizer(texts, DEFAULT_VOCAB_SIZE, folder)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three Parquet sources of 48, 24 and 12 records, each record naming its source (two shards
    each, so dp=2 ranks read a shard of every source)."""
    folder = tmp_path_factory.mktemp("sources")
    streams = []
    for index, (name, count) in enumerate(zip(NAMES, (48, 24, 12), strict=True)):
        records = generate_examples(count, seed=index)
        (folder / name).mkdir()
        for shard in range(2):
            part = records[shard * count // 2 : (shard + 1) * count // 2]
            columns = {
                "prompt": [f"{name} {i}: {r['prompt']}" for i, r in enumerate(part)],
                "response": [r["response"] for r in part],
            }
            pq.write_table(pa.table(columns), folder / name / f"part-{shard}.parquet")
        where = dict(split="train", name=None, columns=(), num_examples=None)
        streams.append(StreamedSource(path=str(folder / name), **where))
    return tuple(streams)


def splits(sources, tokenizer_dir, packing):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    labelling = Labelling(tokenizer=tokenizer, seq_len=SEQ_LEN, loss_on="all_assistant")
    making = row_making(tokenizer_dir, packing)
    mix = StreamedMixSplit(names=NAMES, weights=WEIGHTS, sources=sources, making=making)
    alone = [StreamedSplit(source=source, making=making) for source in sources]
    return mix, alone, labelling


def take(split, labelling, count, position=None, shard=(1, 0), rows_per_step=8):
    position = position or split.start()
    rows = split.rows(position, labelling, shard=shard, rows_per_step=rows_per_step)
    return list(itertools.islice(rows, count))


def test_the_rows_are_the_interleave_over_the_sources_streamed_rows(sources, tokenizer_dir):
    mix, alone, labelling = splits(sources, tokenizer_dir, packing=False)
    rows = [row for row, _ in take(mix, labelling, 1000)]
    order = interleave(integer_weights(list(WEIGHTS)), 0, 1000)
    counts = [sum(1 for s, _ in order if s == source) for source in range(3)]
    own = [
        [r for r, _ in take(split, labelling, n)] for split, n in zip(alone, counts, strict=True)
    ]
    assert rows == [own[source][k] for source, k in order]
    named = [labelling.tokenizer.decode(row[0][0]) for row in rows]
    found = [NAMES.index(re.search(r"(big|mid|small) \d+:", text)[1]) for text in named]
    for source, weight in enumerate(WEIGHTS):  # read from the rows' own text
        assert abs(found.count(source) / 1000 - weight) <= 0.02


def test_dp_ranks_take_the_parts_of_each_step_the_cached_mixture_gives(sources, tokenizer_dir):
    mix, alone, labelling = splits(sources, tokenizer_dir, packing=False)
    ranks = [take(mix, labelling, 24, shard=(2, rank), rows_per_step=4) for rank in (0, 1)]
    scaled = integer_weights(list(WEIGHTS))
    for rank, taken in enumerate(ranks):
        positions = [(n // 4) * 8 + rank * 4 + n % 4 for n in range(24)]
        order = [interleave(scaled, p, 1)[0][0] for p in positions]
        own = [[r for r, _ in take(split, labelling, 24, shard=(2, rank))] for split in alone]
        read = [0, 0, 0]
        expected = []
        for source in order:
            expected.append(own[source][read[source]])
            read[source] += 1
        assert [row for row, _ in taken] == expected
    assert not {tuple(r[0][0]) for r, _ in ranks[0]} & {tuple(r[0][0]) for r, _ in ranks[1]}


def test_a_saved_position_resumes_the_rows_exactly(sources, tokenizer_dir):
    mix, _, labelling = splits(sources, tokenizer_dir, packing=True)
    whole = take(mix, labelling, 60)  # the small source over several epochs
    for stop in (1, 7, 33):
        saved = MixPosition.of_json(whole[stop - 1][1].as_json())
        assert saved.read == stop and all(isinstance(s, StreamPosition) for s in saved.sources)
        again = take(mix, labelling, 20, position=saved)
        assert [row for row, _ in again] == [row for row, _ in whole[stop : stop + 20]]
