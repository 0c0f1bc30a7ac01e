"""Bad input exits non-zero in seconds with one ``error:`` line on stderr, before any rank starts."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_recipe(*overrides: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "recipes/finetune.py", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def bad_jsonl(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"\n')
    return path


CASES = {
    "unknown model": (["model=gpt5"], "Could not find 'model/gpt5'"),
    "misspelt key": (["train.max_stpes=5"], "Could not override 'train.max_stpes'"),
    "tp not dividing heads": (["tp=3", "nproc=3"], "tp (3) must divide num_attention_heads (8)"),
    "world size not factoring": (["tp=4", "nproc=6"], "world size 6 is not divisible by tp=4"),
    "missing pretrained_path": (
        ["model.pretrained_path=/nonexistent/model"],
        "model.pretrained_path '/nonexistent/model' is not a Hugging Face model folder (no config.json)",
    ),
    "ep not dividing tp": (["model=qwen3_moe", "tp=2", "ep=4", "nproc=4"], "ep (4) must divide tp (2)"),
    "dense model with ep": (["ep=2", "tp=2"], "ep=2 needs an MoE model"),
    "batch not dividing": (["train.global_batch_size=10", "train.micro_batch_size=4"], "must be divisible by"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_error_line(case, tmp_path):
    overrides, expected = CASES[case]
    started = time.monotonic()
    result = run_recipe(*overrides, f"output_dir={tmp_path}")
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]


def test_malformed_jsonl_names_the_line(bad_jsonl, tmp_path):
    result = run_recipe("data=jsonl", f"data.path={bad_jsonl}", f"output_dir={tmp_path}")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "line 2" in lines[0], result.stderr
