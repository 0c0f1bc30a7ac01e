"""Tiny Hugging Face configs for tests and benchmarks: a family's group in ``conf/model/`` (the
recipe's default sizes and attention kernel), so that the tiny models tests use are the ones the
recipe runs. Read here, in ``recipes/``, as the recipe reads ``conf/``: no component reads it.
Every tiny size keeps heads, kv heads and experts (8, 4, 8) divisible by 1, 2 and 4. The built
distillation teacher's default is its family's tiny sizes too (``recipes/distill_teacher.py``).
"""

from pathlib import Path
from typing import Any

import yaml
from transformers import PretrainedConfig

from components.models.configs import build_config
from components.models.families import FAMILIES

# Tests' and benchmarks' vocabulary where the group's is null (the tokenizer's).
TINY_VOCAB_SIZE = 256
MODEL_CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
# Families without a group of their own in conf/model/: the group of the same shape.
SHAPED_AS = {"mistral": "llama", "qwen2": "llama"}


def tiny_group(family: str) -> dict[str, Any]:
    """``conf/model/<family>.yaml`` (a family without a group there: :data:`SHAPED_AS`'s)."""
    if family not in FAMILIES:
        raise ValueError(
            f"unknown model family {family!r}; known families: {', '.join(sorted(FAMILIES))}"
        )
    name = SHAPED_AS.get(family, family)
    return yaml.safe_load((MODEL_CONF_DIR / f"{name}.yaml").read_text())


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``conf/model/<family>.yaml`` (the recipe's default sizes and attention
    kernel); ``overrides`` win."""
    group = tiny_group(family)
    sizes = {**group["config"], "attn_implementation": group["attn_implementation"]}
    sizes["vocab_size"] = sizes["vocab_size"] or TINY_VOCAB_SIZE  # null there: the tokenizer's
    return build_config(family, {**sizes, **overrides})
