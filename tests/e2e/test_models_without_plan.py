"""Models without a table entry or a plan of their own, through the command line, on tiny random
folders written by transformers' own ``save_pretrained``: StableLM trains at tp=2 on a plan derived
from its structure, equal to tp=1 (1e-5) whose first loss is the Hugging Face model's own (1e-6),
and so does OPT (its layers deeper, its MLP the block's own linears);
a tokenizer past the embedding is one ``error:`` line, before any rank starts. (GPT-OSS, whose plan
is derived too, sinks and experts included: tests/e2e/test_moe_checkpoints.py.)

By default each derived plan once, SGD and AdamW among them (OPT with SGD, StableLM with AdamW);
the other two pairs run with ``-m sweep``.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from transformers import OPTConfig, StableLmConfig

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests import cli
from tests.saved_models import (
    BATCH,
    COMMON,
    MICRO,
    REPO,
    SEQ_LEN,
    SIZES,
    first_loss,
    recipe,
    save_model,
)

# OPT's names for SIZES: its layers sit in model.decoder.layers, its MLP is the block's own fc1, fc2
OPT_SIZES = dict(
    hidden_size=SIZES["hidden_size"],
    ffn_dim=SIZES["intermediate_size"],
    num_hidden_layers=SIZES["num_hidden_layers"],
    num_attention_heads=SIZES["num_attention_heads"],
    word_embed_proj_dim=SIZES["hidden_size"],
    max_position_embeddings=SIZES["max_position_embeddings"],
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    vocab = len(tokenizer)
    return {
        "cache": root / "cache",
        "stablelm": save_model(
            root / "stablelm", StableLmConfig(**SIZES, vocab_size=vocab), tokenizer
        ),
        "opt": save_model(
            root / "opt",
            OPTConfig(**OPT_SIZES, vocab_size=vocab, dropout=0.0, attention_dropout=0.0),
            tokenizer,
        ),
        "small_vocab": save_model(
            root / "small_vocab", StableLmConfig(**SIZES, vocab_size=vocab // 2), tokenizer
        ),
    }


def losses(
    folders, output_dir: Path, *overrides: str, model: str = "stablelm"
) -> tuple[list[float], str]:
    result = recipe(folders, model, output_dir, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines], result.stdout


# Each model's derived plan, as the plan report prints some of it: StableLM's layers sit beside the
# embeddings; OPT's in model.decoder.layers, its MLP the block's own fc1 and fc2.
DERIVED = {
    "stablelm": "model.layers.*.self_attn.o_proj rowwise",
    "opt": "model.decoder.layers.*.fc1 colwise, model.decoder.layers.*.fc2 rowwise",
}


@pytest.mark.parametrize(
    ("model", "optim"),
    [
        ("opt", "sgd"),
        ("stablelm", "adamw"),
        pytest.param("opt", "adamw", marks=pytest.mark.sweep),
        pytest.param("stablelm", "sgd", marks=pytest.mark.sweep),
    ],
)
def test_at_tp2_on_a_derived_plan_equals_tp1(folders, tmp_path, model, optim):
    tp1, _ = losses(folders, tmp_path / "tp1", "tp=1", f"optim={optim}", model=model)
    tp2, printed = losses(folders, tmp_path / "tp2", "tp=2", f"optim={optim}", model=model)
    assert f"plan derived from the structure of '{model}'" in printed
    assert DERIVED[model] in printed
    assert len(tp1) == 3 and len(set(tp1)) == 3  # the steps train
    assert tp2 == pytest.approx(tp1, rel=1e-5, abs=1e-5)
    reference = first_loss(folders[model], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert tp1[0] == pytest.approx(reference, abs=1e-6)


def test_opt_at_tp2_bf16_mixed_with_checkpointing_finds_its_blocks(folders, tmp_path):
    """What looks for the decoder blocks (bf16-mixed's casts at tp > 1, activation checkpointing)
    finds OPT's as the derived plan does: bf16-mixed tp=2 with every block recomputed follows tp=1
    within bf16's band (tests/e2e/test_precision.py)."""
    mixed = ("train.precision=bf16-mixed", "train.activation_checkpointing=full")
    tp1, _ = losses(folders, tmp_path / "tp1", "tp=1", *mixed, model="opt")
    tp2, _ = losses(folders, tmp_path / "tp2", "tp=2", *mixed, model="opt")
    assert tp2 == pytest.approx(tp1, rel=1e-3)


@pytest.mark.parametrize(
    ("model", "overrides", "expected"),
    [
        ("small_vocab", ["tp=1"], "has token ids up to"),
    ],
)
def test_what_cannot_run_is_one_error_line(folders, tmp_path, model, overrides, expected):
    result = recipe(folders, model, tmp_path / "run", *overrides)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-4000:]
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_vocab_size_smaller_than_the_tokenizer_is_one_error_line(folders, tmp_path):
    command = [sys.executable, "recipes/finetune.py", "model=llama", "model.config.vocab_size=1"]
    command += [*COMMON[1:], f"cache_dir={folders['cache']}", f"output_dir={tmp_path / 'run'}"]
    # the environment of the module's other runs (tests.saved_models.recipe): their zygote
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-4000:]
    assert lines[0].startswith("error: model.config.vocab_size=1 cannot hold the tokenizer")
