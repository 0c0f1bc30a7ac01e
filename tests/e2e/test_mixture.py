"""data=mix from the command line: three sources (the demo set twice, a multi-turn JSONL file) at
dp=2, and a validation loss per source in metrics.jsonl beside the whole split's; a run stopped at
dp=2 and resumed at dp=1 reads the uninterrupted run's batches."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]


def test_a_mixture_trains_and_reports_a_validation_loss_per_source(tmp_path):
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Add {i} and 1"},
                {"role": "assistant", "content": str(i + 1)},
                {"role": "user", "content": f"Reverse: ab{i}"},
                {"role": "assistant", "content": f"{i}ba"},
            ]
        }
        for i in range(40)
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    sources = (
        "[{name:demo,weight:0.6,kind:generated,num_examples:200},"
        "{name:again,weight:0.3,kind:generated,num_examples:100,seed:7},"
        f"{{name:chats,weight:0.1,kind:jsonl,path:{path},val_fraction:0.1}}]"
    )
    output = tmp_path / "run"
    steps = ["train.max_steps=4", "train.val_every=2", "checkpoint.export=false"]
    batch = ["train.global_batch_size=8", "train.micro_batch_size=4"]
    overrides = ["data=mix", f"data.sources={sources}", "dp=2", *steps, *batch]
    command = [sys.executable, "recipes/finetune.py", *overrides, f"output_dir={output}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    validated = [record for record in records if "val_loss" in record]
    assert [record["step"] for record in validated] == [2, 4]
    for record in validated:
        per_source = {key: value for key, value in record.items() if key.startswith("val_loss/")}
        assert sorted(per_source) == ["val_loss/again", "val_loss/chats", "val_loss/demo"]
        assert all(math.isfinite(value) and value > 0 for value in per_source.values())
        assert min(per_source.values()) <= record["val_loss"] <= max(per_source.values())


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_mixture_stopped_at_dp_2_and_resumed_at_dp_1_reads_the_uninterrupted_batches(
    tmp_path, optim
):
    """The step's rows follow from the step alone: the tokens of every step at dp=1 after the
    resume are those of the run that went on at dp=2, and so are its losses (the same rows, summed
    over another number of ranks: equal within float rounding), with SGD and AdamW."""
    sources = (
        "[{name:big,weight:0.6,kind:generated,num_examples:80},"
        "{name:mid,weight:0.3,kind:generated,num_examples:40,seed:7},"
        "{name:small,weight:0.1,kind:generated,num_examples:12,seed:9}]"
    )
    run = ["data=mix", f"data.sources={sources}", "data.val_fraction=0", "train.val_every=0"]
    run += ["train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=6"]
    run += ["checkpoint.every_steps=3", "checkpoint.export=false", f"optim={optim}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}

    def finetune(output: Path, *overrides: str):
        command = [sys.executable, "recipes/finetune.py", *run, *overrides, f"output_dir={output}"]
        return cli.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
        )

    whole, parted = tmp_path / "whole", tmp_path / "parted"
    for output, given in ((whole, ["dp=2"]), (parted, ["dp=2", "train.stop_after=3"])):
        result = finetune(output, *given)
        assert result.returncode == 0, result.stderr[-3000:]
    result = finetune(parted, "dp=1", "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    resumed, uninterrupted = metrics(parted), metrics(whole)
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in uninterrupted]
    assert len({r["tokens"] for r in uninterrupted}) > 1  # the steps' batches tell apart
    for again, first in zip(resumed, uninterrupted, strict=True):
        assert abs(again["loss"] - first["loss"]) <= 1e-5 * first["loss"], again["step"]
