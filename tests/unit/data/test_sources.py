"""Data sources: every local kind ``datasets`` reads, column mapping, and one-line errors for what
cannot work."""

import json

import datasets
import huggingface_hub.constants
import pytest

from components.data.jsonl import DataError, record_problem
from components.data.sources import GeneratedSource, HFSource, JsonlSource, build_source
from components.data.tokenizer import training_texts

ROWS = [{"instruction": f"Add {i} and 1", "output": str(i + 1), "id": i} for i in range(6)]
MAPPING = {"prompt": "instruction", "response": "output"}
EXPECTED = [{"prompt": row["instruction"], "response": row["output"]} for row in ROWS]


def _write_json(path, rows):
    path.write_text(json.dumps(rows))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _write_arrow(path, rows):
    # the Arrow stream format datasets itself writes (its cache files, save_to_disk shards)
    datasets.Dataset.from_list(rows).save_to_disk(str(path.with_suffix(".saved")))
    shard = next(path.with_suffix(".saved").glob("*.arrow"))
    shard.rename(path)


WRITERS = {
    "data.json": _write_json,
    "data.jsonl": _write_jsonl,
    "data.parquet": lambda path, rows: datasets.Dataset.from_list(rows).to_parquet(str(path)),
    "data.csv": lambda path, rows: datasets.Dataset.from_list(rows).to_csv(str(path), index=False),
    "data.arrow": _write_arrow,
    "saved": lambda path, rows: datasets.Dataset.from_list(rows).save_to_disk(str(path)),
    "saved_dict": lambda path, rows: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(path)),
    "folder": lambda path, rows: (path.mkdir(), _write_jsonl(path / "part-0.jsonl", rows)),
}


def source(path, split="train", columns=MAPPING, num_examples=None) -> HFSource:
    return HFSource(
        path=str(path),
        split=split,
        name=None,
        columns=columns,
        num_examples=num_examples,
        val_fraction=0.0,
    )


def error_of(call) -> str:
    with pytest.raises(DataError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_local_kind_loads_with_its_columns_mapped(tmp_path, name):
    path = tmp_path / name
    WRITERS[name](path, ROWS)
    loaded = source(path).load(tmp_path / "cache")
    assert loaded.column_names == ["prompt", "response"]
    assert loaded.to_list() == EXPECTED
    assert len(source(path, num_examples=4).load(tmp_path / "cache")) == 4


def test_fingerprint_follows_the_file_and_the_mapping(tmp_path):
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, ROWS)
    first = source(path).fingerprint()
    assert source(path).fingerprint() == first
    assert source(path, num_examples=3).fingerprint() != first
    assert (
        source(path, columns={"prompt": "output", "response": "instruction"}).fingerprint() != first
    )
    _write_jsonl(path, ROWS[:5])
    assert source(path).fingerprint() != first


def test_own_columns_are_taken_without_a_mapping(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    _write_jsonl(path, [{"messages": messages, "other": 1}])
    assert source(path, columns={}).load(tmp_path / "cache").to_list() == [{"messages": messages}]


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
BOTH_KINDS = [{"messages": MESSAGES}, {"prompt": "Add 1 and 1", "response": "2"}]


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet"])
def test_records_of_both_kinds_keep_their_own_columns(tmp_path, name):
    """``datasets`` gives each row the other kind's columns as None: every row stays usable."""
    path = tmp_path / name
    # JSON Lines as a user writes them; a table's rows have every column, the other kind's null
    table = [{"prompt": None, "response": None, **row} for row in BOTH_KINDS]
    WRITERS[name](path, table if name.endswith(".parquet") else BOTH_KINDS)
    rows = source(path, columns={}).load(tmp_path / "cache").to_list()
    assert [record_problem(row) for row in rows] == [None, None]
    assert training_texts(rows) == ["hi", "hello", "Add 1 and 1", "2"]


@pytest.mark.parametrize(
    ("name", "text"), [("e.jsonl", "\n\n"), ("e.json", ""), ("e.csv", "prompt,response\n")]
)
def test_a_file_of_no_records_is_one_line(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert error_of(lambda: source(path).load(tmp_path / "cache")) == (
        f"data.path={str(path)!r} has no records"
    )
    empty = tmp_path / "e.parquet"
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(empty))
    assert error_of(lambda: source(empty).load(tmp_path / "cache")) == (
        f"data.path={str(empty)!r} has no records"
    )


def test_an_unreadable_file_is_its_parser_s_line_alone(tmp_path, capfd):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", : 1}\n')
    message = error_of(lambda: source(path).load(tmp_path / "cache"))
    assert message.startswith(f"data.path={str(path)!r} cannot be read: JSON parse error: ")
    assert "Failed to load JSON" not in capfd.readouterr().err  # datasets' own line: quiet


def test_a_column_mapping_naming_a_missing_column(tmp_path):
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, ROWS)
    message = error_of(
        lambda: source(path, columns={"prompt": "question", "response": "output"}).load(tmp_path)
    )
    assert message == (
        "data.columns prompt='question': no such column in "
        + str(path)
        + "; its columns are instruction, output, id"
    )


def test_a_column_mapping_onto_something_else(tmp_path):
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, ROWS)
    message = error_of(lambda: source(path, columns={"prompt": "instruction"}).load(tmp_path))
    assert message.startswith(
        "data.columns maps prompt: map exactly prompt and response, or messages"
    )


@pytest.mark.parametrize("name", ["data.jsonl", "saved_dict", "saved"])
def test_a_split_that_does_not_exist(tmp_path, name):
    path = tmp_path / name
    WRITERS[name](path, ROWS)
    message = error_of(lambda: source(path, split="validation").load(tmp_path / "cache"))
    assert message.startswith(f"data.split='validation' is not a split of {path}")


def test_a_hub_id_offline_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    message = error_of(lambda: source("shardtune-tests/no-such-dataset").load(tmp_path))
    assert message.startswith(
        "data.path='shardtune-tests/no-such-dataset' is not a local file or folder and the Hub "
        "cannot be reached"
    )
    assert message.endswith("download it once with a network, or give a local path")


def test_a_missing_local_path_and_an_unknown_suffix(tmp_path):
    missing = tmp_path / "nope.parquet"
    assert error_of(lambda: source(missing).load(tmp_path)) == (
        f"data.path={str(missing)!r} does not exist: give a data file or folder, or a Hub dataset "
        "id"
    )
    text = tmp_path / "data.txt"
    text.write_text("x")
    assert error_of(lambda: source(text).load(tmp_path)).startswith(
        f"data.path={str(text)!r} has suffix '.txt'"
    )


def test_jsonl_source_keeps_the_line_numbered_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"\n')
    bad = JsonlSource(path=str(path), num_examples=None, val_fraction=0.0)
    assert (
        error_of(lambda: bad.load(tmp_path))
        == f"{path} line 2: not valid JSON (Expecting ',' delimiter)"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    source = JsonlSource(path=str(empty), num_examples=None, val_fraction=0.0)
    assert error_of(lambda: source.load(tmp_path)) == (
        f"{empty} has no records: expected one JSON object per line"
    )


def test_jsonl_source_takes_both_shapes_as_messages(tmp_path):
    path = tmp_path / "mixed.jsonl"
    chat = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    _write_jsonl(path, [{"prompt": "p", "response": "r"}, {"messages": chat}])
    source = JsonlSource(path=str(path), num_examples=None, val_fraction=0.0)
    loaded = source.load(tmp_path).to_list()
    assert loaded == [
        {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]},
        {"messages": chat},
    ]


def test_generated_source_is_the_generated_set(tmp_path):
    from components.data.generated import generate_examples

    generated = GeneratedSource(num_examples=30, val_fraction=0.1, seed=4)
    assert generated.load(tmp_path).to_list() == generate_examples(30, 4)
    assert (
        generated.fingerprint()
        != GeneratedSource(num_examples=30, val_fraction=0.1, seed=5).fingerprint()
    )


def test_build_source_by_target_and_its_errors():
    built = build_source(
        {
            "_target_": "components.data.sources.JsonlSource",
            "path": "x.jsonl",
            "num_examples": None,
            "val_fraction": 0.1,
        }
    )
    assert built == JsonlSource(path="x.jsonl", num_examples=None, val_fraction=0.1)
    assert error_of(lambda: build_source({"_target_": "os.system"})).startswith(
        "data._target_='os.system' is not a data source: use one of "
        "components.data.sources.EmbeddedPreferenceSource, components.data.sources.GeneratedSource"
    )
    assert error_of(
        lambda: build_source(
            {
                "_target_": "components.data.sources.JsonlSource",
                "path": "x",
                "val_fraction": 0.1,
                "splitt": 1,
            }
        )
    ) == (
        "data.splitt is not a key of JsonlSource; data.num_examples is missing (a field of "
        "JsonlSource)"
    )
