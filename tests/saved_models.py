"""Tiny models written by transformers' own ``save_pretrained``, run through the command line, and
the Hugging Face model's own losses on the batches such a run used (the recipe's generated data,
prepared into the run's cache the same way), for parity checks."""

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from components.data import GeneratedSource, StepBatches, prepare_data
from tests import cli

REPO = Path(__file__).resolve().parents[1]
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


def save_model(folder: Path, config, tokenizer, seed: int = 0) -> Path:
    """A random model of ``config`` (its weights by ``seed``) and ``tokenizer``, saved in
    ``folder``."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_folders(root: Path) -> dict[str, Path]:
    """Tiny model folders for ``dpo.reference_path``: a Llama ``policy`` and a ``reference`` of
    its shape and tokenizer with other weights (seed 1); a Llama of ``another_tokenizer`` and a
    ``qwen3`` model of the policy's tokenizer."""
    from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
    from recipes.tiny_models import tiny_config

    texts = ["what is the answer", "fine tuning", "other words"]
    one = train_tokenizer(texts[:2], DEFAULT_VOCAB_SIZE, root / "one")
    other = train_tokenizer(texts[1:], DEFAULT_VOCAB_SIZE, root / "other")
    made = {}
    for name, family, tokenizer, seed in (
        ("policy", "llama", one, 0),
        ("reference", "llama", one, 1),
        ("another_tokenizer", "llama", other, 1),
        ("qwen3", "qwen3", one, 1),
    ):
        config = tiny_config(family, vocab_size=len(tokenizer), **SIZES)
        made[name] = save_model(root / name, config, tokenizer, seed)
    return made


def recipe(
    folders: dict[str, Path], model: str, output_dir: Path, *overrides: str, timeout: float = 300
):
    """The recipe on ``folders[model]`` with :data:`COMMON` settings and ``folders["cache"]``,
    within ``timeout`` seconds."""
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
    return cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=environment
    )


def _prepared(folder: Path, cache: Path, seq_len: int, num_examples: int):
    source = GeneratedSource(num_examples=num_examples, val_fraction=0.02, seed=0)
    options = dict(seq_len=seq_len, loss_on="all_assistant", packing=False, seed=0)
    return prepare_data(source, folder, **options, cache_root=cache, num_proc=1)


def first_batch(
    folder: Path, cache: Path, seq_len: int, batch: int, micro: int, num_examples: int = 64
) -> dict[str, torch.Tensor]:
    """The recipe's first global batch as ``input_ids`` and ``labels``."""
    prepared = _prepared(folder, cache, seq_len, num_examples)
    step = StepBatches.open(prepared.train, batch, micro, dp_size=1, dp_rank=0, seed=0)
    micro_batches = step.batches_for_step(0)
    return {
        "input_ids": torch.cat([b.input_ids for b in micro_batches]),
        "labels": torch.cat([b.labels for b in micro_batches]),
    }


def first_loss(
    folder: Path, cache: Path, seq_len: int, batch: int, micro: int, num_examples: int = 64
) -> float:
    """``from_pretrained(folder)``'s loss (``labels=``) on the recipe's first global batch."""
    inputs = first_batch(folder, cache, seq_len, batch, micro, num_examples)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(**inputs).loss.item()


def validation_loss(folder: Path, cache: Path, seq_len: int, num_examples: int = 64) -> float:
    """``from_pretrained(folder)``'s mean loss per labelled token on the run's validation rows."""
    prepared = _prepared(folder, cache, seq_len, num_examples)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    batches = StepBatches.open(prepared.val, 1, 1, dp_size=1, dp_rank=0, seed=0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches.all_batches():
            logits = model(input_ids=batch.input_ids).logits[:, :-1].flatten(0, 1)
            labels = batch.labels[:, 1:].flatten()
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            tokens += batch.labelled_tokens()
    return total / tokens
