"""Sequence parallelism on every norm of the residual stream, found from the structure: Gemma 2 and
Gemma 3 (four norms a block) and Cohere (one, before parallel attention and MLP) at tp=2 sp=true
train as at tp=1 (1e-5), through the command line on folders written by ``save_pretrained``.

By default Gemma 3 with SGD (four norms a block, and per-head q/k norms whose gradients are
summed over the heads' ranks) and Cohere with AdamW (its one norm before parallel attention and
MLP); Gemma 2 with both optimizers and Gemma 3 with AdamW, the same four norms again, run with
``-m sweep``.
"""

import json
from pathlib import Path

import pytest
from transformers import CohereConfig, Gemma2Config, Gemma3TextConfig

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.e2e.test_models_without_plan import SIZES, recipe, save_model
from tests.selection import selected_params

IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # within the tiny vocabulary
CONFIGS = {
    "gemma2": lambda vocab: Gemma2Config(**SIZES, **IDS, head_dim=16, vocab_size=vocab),
    "gemma3": lambda vocab: Gemma3TextConfig(**SIZES, **IDS, head_dim=16, vocab_size=vocab),
    "cohere": lambda vocab: CohereConfig(**SIZES, **IDS, vocab_size=vocab),
}


@pytest.fixture(scope="module")
def folders(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    built = {  # only the families of the selected cases; tp divides the vocabulary
        name: save_model(root / name, CONFIGS[name](DEFAULT_VOCAB_SIZE), tokenizer)
        for name in selected_params(request, "model")
    }
    return {"cache": root / "cache", **built}


def losses(folders, model: str, output_dir: Path, *overrides: str) -> list[float]:
    result = recipe(folders, model, output_dir, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


# the same four norms a block again, with the other optimizer too
SWEPT = [("gemma2", "sgd"), ("gemma2", "adamw"), ("gemma3", "adamw")]


@pytest.mark.parametrize(
    ("model", "optim"),
    [("gemma3", "sgd"), ("cohere", "adamw")]
    + [pytest.param(*case, marks=pytest.mark.sweep) for case in SWEPT],
)
def test_tp2_with_sequence_parallel_norms_equals_tp1(folders, tmp_path, model, optim):
    tp1 = losses(folders, model, tmp_path / "tp1", "tp=1", f"optim={optim}")
    sp = losses(folders, model, tmp_path / "sp", "tp=2", "sp=true", f"optim={optim}")
    assert len(set(tp1)) == 3  # the steps train
    assert sp == pytest.approx(tp1, rel=1e-5, abs=1e-5)
