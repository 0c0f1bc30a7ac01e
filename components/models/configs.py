"""Tiny embedded configurations of the four supported families, for tests, demos and the default recipe run.

Every size is small enough for a 2-core CPU, and the head, kv-head and expert counts (8, 4, 8) divide by
1, 2 and 4, so each config runs at tp = 1, 2 or 4 with whole heads (and whole experts) on every rank.
"""

import torch
from transformers import LlamaConfig, MixtralConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

# Shared by every family: 8 query heads of size 8 (hidden 64) sharing 4 kv heads.
_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "tie_word_embeddings": False,
    "dtype": torch.float32,
    # HF 5 attention reshapes q/k/v with -1 heads, so a rank holding only its local heads works with sdpa.
    "attn_implementation": "sdpa",
}

FAMILIES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, {}),
    "qwen3": (Qwen3Config, {}),  # dense, with q/k norms
    "qwen3_moe": (Qwen3MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
    "mixtral": (MixtralConfig, {"num_local_experts": 8, "num_experts_per_tok": 2}),
}


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny fp32 config of ``family`` ("llama", "qwen3", "qwen3_moe" or "mixtral"); ``overrides`` win.

    Raises:
        ValueError: If ``family`` is not one of the known families.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {', '.join(sorted(FAMILIES))}")
    config_class, family_sizes = FAMILIES[family]
    return config_class(**{**_COMMON, **family_sizes, **overrides})
