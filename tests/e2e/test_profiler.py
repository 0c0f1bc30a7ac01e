"""``profile.steps`` through the real command line: a tp=2 run writes one Chrome trace per rank
holding the asked steps (and only those), and a bad request is refused with one ``error:`` line
before any rank starts."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from components.training.profiler import host_syncs_per_step
from tests import cli

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "train.max_steps=3",
    "train.warmup_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


def recipe(output_dir: Path, *overrides: str):
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={output_dir}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(
        [*command, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )


def test_a_tp2_run_writes_one_trace_per_rank_of_the_asked_steps(tmp_path):
    result = recipe(tmp_path, "tp=2", "profile.steps=[2,3]")
    assert result.returncode == 0, result.stderr[-4000:]
    folder = tmp_path / "profile"
    assert sorted(path.name for path in folder.iterdir()) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    for rank in (0, 1):
        trace = folder / f"rank{rank}.pt.trace.json"
        events = json.loads(trace.read_text())["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, (rank, steps)
        names = {event.get("name") for event in events}
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, rank  # the model and update
        syncs = host_syncs_per_step(trace)
        assert set(syncs) == {2, 3} and min(syncs.values()) >= 1, syncs  # the grad norm read


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["profile.steps=[2,4]"], "profile.steps=[2,4] goes past the run's last step (3)"),
        (["profile.steps=[3,2]"], "profile.steps=[3,2] is not a range"),
        (["profile.steps=[0,2]"], "profile.steps=0 is not valid: use null (off) or [FIRST, LAST]"),
        pytest.param(
            ["profile.memory=true", "profile.steps=[1,2]"],
            "profile.memory=true is a CUDA memory snapshot: not supported on the CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA takes it"),
        ),
    ],
)
def test_a_bad_request_is_one_error_line_before_any_rank_starts(tmp_path, overrides, says):
    result = recipe(tmp_path / "run", "tp=2", *overrides)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
