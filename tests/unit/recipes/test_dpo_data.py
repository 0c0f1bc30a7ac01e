"""``recipes/dpo.py``'s data as its checks and preparation read it (in process, no rank): a pair
whose prompt holds an earlier assistant turn is labelled on its final answer alone, whatever
data group reads it (``data=jsonl``'s group default labels every assistant turn for
``finetune.py``); asking ``data.loss_on=all_assistant`` of dpo.py is one line; ``data=hf`` reads
preference records; ``data.streaming=true`` is one line naming the one fix. The records are the
new-user trial's (``mt_pairs.jsonl``, ``hh_pairs.jsonl``), inline."""

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from components.data.collate import IGNORE_INDEX, tokenize_example
from components.data.loader import open_tokens
from components.data.preference import pair_conversations
from recipes.compose import compose_dpo
from recipes.dpo_checks import check_dpo
from recipes.prepare import prepare_run_data
from tests.unit.data.test_prepare import tokenizer_dir  # noqa: F401 - the fixture
from tests.unit.recipes.test_distill_checks import refusals_of


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def multi_turn(a: int, b: int) -> dict:
    """A record of mt_pairs.jsonl: a prompt of three turns, the second the assistant's."""
    product = a * b
    asked = [user(f"What is {a} times {b}?"), assistant(f"It is {product}, a fine number indeed.")]
    asked.append(user("And plus one?"))
    chosen, rejected = [assistant(f"{product + 1}.")], [assistant(f"{product + 2}.")]
    return {"prompt": asked, "chosen": chosen, "rejected": rejected}


MULTI_TURN = [multi_turn(16, 38), multi_turn(35, 9), multi_turn(24, 39), multi_turn(31, 41)]
# the same pairs as hh_pairs.jsonl writes them: whole conversations, the prompt implicit
IMPLICIT = [
    {name: record["prompt"] + record[name] for name in ("chosen", "rejected")}
    for record in MULTI_TURN
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def prepared_rows(tmp_path: Path, tokenizer_folder: Path, *overrides: str) -> list[tuple]:
    """(input_ids, labels) of every conversation ``dpo.py`` prepares from ``overrides``, in the
    records' order (chosen, then rejected), as its checks and preparation make them."""
    cfg = compose_dpo(
        [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}", *overrides]
    )
    checked = check_dpo(cfg, None, None)
    settings, dims = checked.settings, checked.dims
    prepared, found = prepare_run_data(settings, checked.source, tokenizer_folder, dims)
    assert not found
    tokens = open_tokens(str(Path(prepared.folder) / "tokens"))
    return list(zip(tokens["input_ids"], tokens["labels"], strict=True))


def expected_rows(tokenizer_folder: Path, records: list[dict], loss_on: str) -> list[tuple]:
    """Each record's conversations as ``finetune.py`` labels them with ``loss_on``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    rows = []
    for record in records:
        for messages in pair_conversations(record):
            ids, labels = tokenize_example({"messages": messages}, tokenizer, 128, loss_on)
            rows.append((ids, [IGNORE_INDEX, *labels[1:]]))
    return rows


@pytest.mark.parametrize("form", ["prompt_messages", "implicit_prompt", "implicit_prompt_hf"])
def test_a_multi_turn_pair_is_labelled_on_its_final_answer_alone(tmp_path, tokenizer_dir, form):  # noqa: F811
    """data=jsonl (whose group labels every assistant turn for finetune.py) and data=hf give
    each answer the labels of its conversation with the earlier turns' labels off."""
    records = IMPLICIT if form.startswith("implicit") else MULTI_TURN
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    group = "data=hf" if form.endswith("_hf") else "data=jsonl"
    data = [group, f"data.path={path}", "data.val_fraction=0", "train.val_every=0"]
    data += ["train.seq_len=128"]
    rows = prepared_rows(tmp_path, tokenizer_dir, *data)
    assert rows == expected_rows(tokenizer_dir, MULTI_TURN, "last_assistant")
    assert rows != expected_rows(tokenizer_dir, MULTI_TURN, "all_assistant")  # not a no-op


def test_asking_every_assistant_turn_of_dpo_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", MULTI_TURN)
    data = ["data=jsonl", f"data.path={path}", "data.loss_on=all_assistant"]
    assert refusals_of(compose_dpo, check_dpo, tmp_path, *data) == [
        "data.loss_on='all_assistant' is not run by dpo.py: it scores each pair's final answer "
        "alone (earlier assistant turns are prompt, conf/dpo_over_groups.yaml): leave "
        "data.loss_on out, or use data.loss_on=last_assistant"
    ]


def test_a_parquet_file_of_pairs_is_read_as_the_same_pairs_as_jsonl(tmp_path, tokenizer_dir):  # noqa: F811
    """Mixed forms in one file: datasets gives a record without "prompt" a None there."""
    records = [*MULTI_TURN[:2], *IMPLICIT[2:]]
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", records)
    parquet = tmp_path / "pairs.parquet"
    datasets.load_dataset("json", data_files=str(jsonl), split="train").to_parquet(parquet)
    common = ["data.val_fraction=0", "train.val_every=0", "train.seq_len=128"]
    from_hf = prepared_rows(
        tmp_path / "hf", tokenizer_dir, "data=hf", f"data.path={parquet}", *common
    )
    from_jsonl = prepared_rows(
        tmp_path / "jsonl", tokenizer_dir, "data=jsonl", f"data.path={jsonl}", *common
    )
    assert from_hf == from_jsonl == expected_rows(tokenizer_dir, MULTI_TURN, "last_assistant")


@pytest.mark.parametrize("group", ["data=jsonl", "data=hf", "data=preference"])
def test_streaming_pairs_is_one_line_naming_the_fix(tmp_path, group):
    """No word of data=hf (which streams no pairs either) nor of validation keys dpo.py does
    not read."""
    path = write_jsonl(tmp_path / "pairs.jsonl", MULTI_TURN)
    data = [group, "data.streaming=true"]
    data += [f"data.path={path}"] if group != "data=preference" else []
    assert refusals_of(compose_dpo, check_dpo, tmp_path, *data) == [
        "data.streaming=true: preference pairs are tokenized into the cache before training, "
        "never streamed: use data.streaming=false"
    ]


@pytest.mark.parametrize("group", ["data=jsonl", "data=hf", "data=preference"])
def test_dpo_reads_train_val_every_as_fine_tuning_does(tmp_path, group, capsys):
    """dpo.py validates on the held-out pairs: train.val_every is fine-tuning's (20; 0 in
    data=preference's group, which holds nothing out), a given value kept, no note."""
    path = write_jsonl(tmp_path / "pairs.jsonl", MULTI_TURN)
    data = [group] + ([f"data.path={path}"] if group != "data=preference" else [])
    run = [f"output_dir={tmp_path / 'run'}", *data]
    default = 0 if group == "data=preference" else 20
    assert check_dpo(compose_dpo(run), None, None).settings.train.val_every == default
    assert (
        check_dpo(compose_dpo([*run, "train.val_every=5"]), None, None).settings.train.val_every
        == 5
    )
    assert "val_every" not in capsys.readouterr().out
