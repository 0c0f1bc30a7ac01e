"""data.streaming=true from the command line: a run stopped at step 7 and resumed at the same dp
has the uninterrupted run's losses exactly; a resume at another dp is one error: line."""

import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from components.data.generated import generate_examples
from tests import cli

REPO = Path(__file__).resolve().parents[2]


def finetune(output: Path, *overrides: str):
    command = [sys.executable, "recipes/finetune.py", *overrides, f"output_dir={output}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment)


def metrics(output: Path) -> list[tuple[int, float, int]]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["tokens"]) for r in map(json.loads, lines)]


def test_a_stream_resumes_exactly_at_its_dp_and_is_refused_at_another(tmp_path):
    records, data = generate_examples(240, seed=3), tmp_path / "data"
    data.mkdir()
    for shard in range(4):  # dp 2 reads two whole shards each: 60 records a shard, two epochs
        part = records[shard * 60 : (shard + 1) * 60]
        table = pa.table({key: [record[key] for record in part] for key in ("prompt", "response")})
        pq.write_table(table, data / f"part-{shard}.parquet", row_group_size=16)
    stream = [f"data.path={data}", "data.val_fraction=0", "train.val_every=0", "dp=2"]
    run = ["data=hf", "data.streaming=true", *stream, "train.packing=true", "train.max_steps=9"]
    run += ["checkpoint.every_steps=7", "checkpoint.export=false"]
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    for output, given in ((whole, []), (parted, ["train.stop_after=7"])):
        result = finetune(output, *run, *given)
        assert result.returncode == 0, result.stderr[-3000:]
    assert len(metrics(parted)) == 7
    result = finetune(parted, *run, "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    assert metrics(parted) == metrics(whole)  # steps 8 and 9 read where step 7 stopped
    assert [step for step, _, _ in metrics(whole)] == list(range(1, 10))
    at_one = [*run[:-2], "dp=1", "checkpoint.resume=auto", "train.max_steps=12"]
    refused = finetune(parted, *at_one)
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    refusal = (
        "dp (a stream resumes at the dp it was read at) is 1 but the checkpoint was written with 2"
    )
    assert line.startswith("error: ") and refusal in line
