"""Dropout under tensor parallelism, through the command line: Seed-OSS with its attention and
residual dropout (0.1) at tp=2 keeps every replicated parameter equal on both ranks (the drift
report, checked every step, stays 0), its first loss is a draw from the same distribution as the
Hugging Face model's own over dropout masks, as tp=1's is, and activation checkpointing (blocks
recomputed in backward) trains exactly as without.
"""

import json
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, SeedOssConfig

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.e2e.test_sequence_parallel_norms import IDS, losses
from tests.saved_models import BATCH, MICRO, SEQ_LEN, SIZES, first_batch, save_model

DROPOUT = dict(attention_dropout=0.1, residual_dropout=0.1)
MASKS = 64  # dropout draws of the Hugging Face model's loss that give its mean and spread


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    config = SeedOssConfig(**SIZES, **IDS, **DROPOUT, head_dim=16, vocab_size=DEFAULT_VOCAB_SIZE)
    return {"cache": root / "cache", "seed_oss": save_model(root / "seed_oss", config, tokenizer)}


def loss_over_masks(folder: Path, cache: Path) -> tuple[float, float]:
    """The mean and standard deviation of the Hugging Face model's first-batch loss in training
    mode over :data:`MASKS` dropout draws."""
    inputs = first_batch(folder, cache, SEQ_LEN, BATCH, MICRO)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    torch.manual_seed(1)
    with torch.no_grad():
        draws = [model(**inputs).loss.item() for _ in range(MASKS)]
    return statistics.mean(draws), statistics.stdev(draws)


def test_dropout_at_tp2_keeps_replicas_equal_and_the_loss_within_its_noise(folders, tmp_path):
    tp1 = losses(folders, "seed_oss", tmp_path / "tp1", "tp=1")
    tp2 = losses(folders, "seed_oss", tmp_path / "tp2", "tp=2", "debug.check_replicas_every=1")
    recomputed = losses(
        folders, "seed_oss", tmp_path / "ac", "tp=2", "train.activation_checkpointing=full"
    )
    drift = json.loads((tmp_path / "tp2" / "replica_drift.json").read_text())
    assert drift["max"] == 0.0 and len(drift["tensors"]) > 0
    mean, spread = loss_over_masks(folders["seed_oss"], folders["cache"])
    assert spread > 1e-3  # dropout acts: the masks move the loss
    # 4 standard deviations: a loss drawn from the same distribution falls outside once in ~16,000
    assert abs(tp1[0] - mean) <= 4 * spread, (tp1[0], mean, spread)
    assert abs(tp2[0] - mean) <= 4 * spread, (tp2[0], mean, spread)
    assert tp2[0] != tp1[0]  # masks of their own: tp=2 draws per rank in its sharded regions
    assert recomputed == tp2  # a block recomputed in backward draws the masks of its forward
