"""Context parallelism keeps the attention the model's config asks for, through the command line:
Qwen3 with a sliding window of 8 on every layer (``max_window_layers=0``, SGD) and with
Gemma-3-style layers alternating sliding and full (``layer_types``, AdamW) train at ``cp=2``
what they train at ``cp=1`` (loss, grad norm and validation loss within 1e-5 relative over 3
fp32 steps, seq 64); the window matters (``cp=1`` with it is far from ``cp=1`` without it); and
layers context parallelism has no mask for are one ``error:`` line before any rank starts.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import cli
from tests.e2e.test_context_parallel import worst_gap  # loss, grad norm, val loss

pytestmark = pytest.mark.timeout(600)  # the module fixture's runs count against the first test

REPO = Path(__file__).resolve().parents[2]
COMMON = ["model=qwen3", "train.max_steps=3", "train.warmup_steps=1", "train.val_every=3"]
COMMON += ["train.seq_len=64", "data.num_examples=100", "checkpoint.export=false"]
COMMON += ["train.global_batch_size=4", "train.micro_batch_size=4"]
WINDOW = ["+model.config.use_sliding_window=true", "+model.config.sliding_window=8"]
EVERY_LAYER = [*WINDOW, "+model.config.max_window_layers=0", "optim=sgd", "optim.lr=0.5"]
ALTERNATING = [*WINDOW, "+model.config.layer_types=[sliding_attention,full_attention]"]
RUNS = {
    "window_cp1": EVERY_LAYER,
    "window_cp2": [*EVERY_LAYER, "cp=2"],
    "no_window_cp1": ["optim=sgd", "optim.lr=0.5"],
    "alternating_cp1": ALTERNATING,
    "alternating_cp2": [*ALTERNATING, "cp=2"],
}


def recipe(output_dir: Path, *overrides: str):
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={output_dir}"]
    command += list(overrides)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment)


def metrics(output_dir: Path, *overrides: str) -> list[dict]:
    result = recipe(output_dir, *overrides)
    assert result.returncode == 0, f"{overrides}\n{result.stderr[-3000:]}"
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp_windows")
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda name: metrics(root / name, *RUNS[name]), RUNS)
        return dict(zip(RUNS, results, strict=True))


@pytest.mark.parametrize("name", ["window", "alternating"])
def test_cp2_trains_what_cp1_trains_with_the_window(runs, name):
    ours, reference = runs[f"{name}_cp2"], runs[f"{name}_cp1"]
    assert [record["step"] for record in ours] == [1, 2, 3] and "val_loss" in ours[-1]
    print(f"{name}: worst gap {worst_gap(ours, reference):.1e}")
    assert worst_gap(ours, reference) <= 1e-5


def test_the_window_matters(runs):
    """Without this, the parity above could hold with the window dropped on both sides."""
    gap = worst_gap(runs["window_cp1"], runs["no_window_cp1"])
    print(f"window against none at cp=1: {gap:.1e}")
    assert gap > 1e-3


def test_layers_cp_has_no_mask_for_are_one_error_line(tmp_path):
    layers = "+model.config.layer_types=[sliding_attention,linear_attention]"
    result = recipe(tmp_path / "linear", *WINDOW, layers, "cp=2")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "cp=2 with a model with linear_attention" in lines[0]
    assert "not supported" in lines[0] and not (tmp_path / "linear").exists()
