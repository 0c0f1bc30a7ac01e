"""data.streaming=true from the command line: a run stopped at step 7 (a streamed mixture's at
step 3) and resumed at the same dp has the uninterrupted run's losses and tokens exactly; a resume
at another dp is one error: line."""

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


def uninterrupted_and_resumed(tmp_path: Path, run: list[str], stop: int) -> tuple[Path, Path]:
    """The output folders of ``run`` uninterrupted, and stopped after step ``stop`` then resumed
    with ``checkpoint.resume=auto``."""
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    for output, given in ((whole, []), (parted, [f"train.stop_after={stop}"])):
        result = finetune(output, *run, *given)
        assert result.returncode == 0, result.stderr[-3000:]
    assert len(metrics(parted)) == stop
    result = finetune(parted, *run, "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    return whole, parted


def assert_refused_at_dp_1(parted: Path, run: list[str]) -> None:
    """A resume of ``parted``'s dp=2 stream at dp=1 is one error: line."""
    refused = finetune(parted, *run, "dp=1", "checkpoint.resume=auto")
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    refusal = (
        "dp (a stream resumes at the dp it was read at) is 1 but the checkpoint was written with 2"
    )
    assert line.startswith("error: ") and refusal in line


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
    whole, parted = uninterrupted_and_resumed(tmp_path, run, stop=7)
    assert metrics(parted) == metrics(whole)  # steps 8 and 9 read where step 7 stopped
    assert [step for step, _, _ in metrics(whole)] == list(range(1, 10))
    assert_refused_at_dp_1(parted, [*run[:-2], "train.max_steps=12"])


def test_a_streamed_mixture_stopped_and_resumed_at_its_dp_has_the_uninterrupted_steps(tmp_path):
    """data=mix of two streamed Parquet sources at dp=2: steps 4 and 5 after a stop at step 3 have
    the uninterrupted run's losses and tokens exactly (each rank's position in each source and in
    the interleave came back from the checkpoint); at dp=1 the resume is one error: line."""
    sources = []
    for index, (name, count) in enumerate((("chat", 64), ("general", 32))):
        records, folder = generate_examples(count, seed=index), tmp_path / name
        folder.mkdir()
        for shard in range(2):  # dp 2 reads a whole shard of each source
            part = records[shard * count // 2 : (shard + 1) * count // 2]
            columns = {key: [record[key] for record in part] for key in ("prompt", "response")}
            pq.write_table(pa.table(columns), folder / f"part-{shard}.parquet")
        sources.append(f"{{name:{name},weight:{0.7 if index == 0 else 0.3},kind:hf,path:{folder}}}")
    run = ["data=mix", f"data.sources=[{','.join(sources)}]", "data.streaming=true", "dp=2"]
    run += ["data.val_fraction=0", "train.val_every=0", "train.packing=true", "train.max_steps=5"]
    run += ["checkpoint.every_steps=3", "checkpoint.export=false"]
    whole, parted = uninterrupted_and_resumed(tmp_path, run, stop=3)
    assert metrics(parted) == metrics(whole)
    assert [step for step, _, _ in metrics(whole)] == [1, 2, 3, 4, 5]
    assert_refused_at_dp_1(parted, [*run, "train.max_steps=6"])
