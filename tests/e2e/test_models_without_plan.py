"""Models without a table entry or a plan of their own, through the command line, on tiny random
folders written by transformers' own ``save_pretrained``: StableLM trains at tp=2 on a plan derived
from its structure, equal to tp=1 (1e-5) whose first loss is the Hugging Face model's own (1e-6);
what cannot be derived (GPT-OSS's sinks and experts) and a tokenizer past the embedding are one
``error:`` line each, before any rank starts.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, StableLmConfig

from components.data import (
    DEFAULT_VOCAB_SIZE,
    GeneratedSource,
    StepBatches,
    prepare_data,
    train_tokenizer,
)
from tests import cli

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, BATCH, MICRO = 32, 4, 2
COMMON = [
    "model=pretrained",
    "train.max_steps=3",
    f"train.global_batch_size={BATCH}",
    f"train.micro_batch_size={MICRO}",
    f"train.seq_len={SEQ_LEN}",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=64",
]
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def save_model(folder: Path, config, tokenizer) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    vocab = len(tokenizer)
    rope = {"rope_type": "default", "rope_theta": 10000.0}  # its YaRN default warns at 128
    gpt_oss = GptOssConfig(
        **SIZES, vocab_size=vocab, num_local_experts=4, head_dim=16, rope_parameters=rope
    )
    return {
        "cache": root / "cache",
        "stablelm": save_model(
            root / "stablelm", StableLmConfig(**SIZES, vocab_size=vocab), tokenizer
        ),
        "gpt_oss": save_model(root / "gpt_oss", gpt_oss, tokenizer),
        "small_vocab": save_model(
            root / "small_vocab", StableLmConfig(**SIZES, vocab_size=vocab // 2), tokenizer
        ),
    }


def recipe(folders: dict[str, Path], model: str, output_dir: Path, *overrides: str):
    command = [
        sys.executable,
        "recipes/finetune.py",
        *COMMON,
        f"model.pretrained_path={folders[model]}",
        f"cache_dir={folders['cache']}",
        f"output_dir={output_dir}",
        *overrides,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment)


def losses(folders, output_dir: Path, *overrides: str) -> tuple[list[float], str]:
    result = recipe(folders, "stablelm", output_dir, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines], result.stdout


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_stablelm_at_tp2_on_a_derived_plan_equals_tp1(folders, tmp_path, optim):
    tp1, _ = losses(folders, tmp_path / "tp1", "tp=1", f"optim={optim}")
    tp2, printed = losses(folders, tmp_path / "tp2", "tp=2", f"optim={optim}")
    assert "plan derived from the structure of 'stablelm'" in printed
    assert "model.layers.*.self_attn.o_proj rowwise" in printed
    assert len(tp1) == 3 and len(set(tp1)) == 3  # the steps train
    assert tp2 == pytest.approx(tp1, rel=1e-5, abs=1e-5)
    if optim == "sgd":
        assert tp1[0] == pytest.approx(hf_first_loss(folders), abs=1e-6)


def hf_first_loss(folders, model: str = "stablelm") -> float:
    """The Hugging Face model's own loss (``labels=``) on the recipe's first global batch."""
    folder = folders[model]
    source = GeneratedSource(num_examples=64, val_fraction=0.02, seed=0)
    prepared = prepare_data(
        source,
        folder,
        seq_len=SEQ_LEN,
        packing=False,
        seed=0,
        cache_root=folders["cache"],
        num_proc=1,
    )
    batches = StepBatches.open(prepared.train, BATCH, MICRO, dp_size=1, dp_rank=0, seed=0)
    step = batches.batches_for_step(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(
            input_ids=torch.cat([b.input_ids for b in step]),
            labels=torch.cat([b.labels for b in step]),
        ).loss.item()


@pytest.mark.parametrize(
    ("model", "overrides", "expected"),
    [
        (
            "gpt_oss",
            ["tp=2"],
            "model type 'gpt_oss' has no tensor-parallel plan, and one derived from its structure "
            "cannot place model.layers.*.self_attn (its parameter sinks), model.layers.*.mlp",
        ),
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
    result = cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-4000:]
    assert lines[0].startswith("error: model.config.vocab_size=1 cannot hold the tokenizer")
