"""tiny_config: four small families whose heads, kv heads and experts divide by 1, 2 and 4; the
vocabulary of a model built from a config."""

import pytest
import torch

from components.models import build_causal_lm
from components.models.configs import vocab_size_errors, vocab_size_for
from recipes.tiny_models import tiny_config

FAMILIES = ["llama", "qwen3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_and_runs_a_forward(family):
    config = tiny_config(family)
    model = build_causal_lm(config, seed=0)
    logits = model(torch.arange(16).reshape(2, 8)).logits
    assert logits.shape == (2, 8, 256) and logits.dtype == torch.float32 and logits.isfinite().all()
    assert model.model.embed_tokens.weight.shape == (256, 64) and len(model.model.layers) == 2
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    assert config._attn_implementation == "sdpa" and config.max_position_embeddings == 512


@pytest.mark.parametrize("family", FAMILIES)
def test_counts_divide_by_one_two_and_four(family):
    config = tiny_config(family)
    counts = [
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim * config.num_attention_heads,
    ]
    counts += [getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 8)]
    assert all(count % 4 == 0 for count in counts), counts


def test_moe_families_have_eight_experts_two_per_token():
    qwen3_moe, mixtral = tiny_config("qwen3_moe"), tiny_config("mixtral")
    assert (
        qwen3_moe.num_experts,
        qwen3_moe.num_experts_per_tok,
        qwen3_moe.moe_intermediate_size,
    ) == (8, 2, 64)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)


def test_overrides_win():
    config = tiny_config("llama", num_hidden_layers=1, tie_word_embeddings=True)
    assert config.num_hidden_layers == 1 and config.tie_word_embeddings


def test_unknown_family_lists_the_known_ones():
    known = "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"  # components.models.families
    with pytest.raises(ValueError, match=f"unknown model family 'gpt2'; known families: {known}"):
        tiny_config("gpt2")


def test_a_given_vocab_size_is_applied_and_one_too_small_refused():
    assert vocab_size_for(None, 300) == 300
    assert vocab_size_for(512, 300) == 512
    with pytest.raises(ValueError, match="vocab_size=1 is smaller than the tokenizer's 300"):
        vocab_size_for(1, 300)
    assert "cannot hold the tokenizer" in vocab_size_errors({"vocab_size": 1})[0]
    assert vocab_size_errors({"vocab_size": None}) == vocab_size_errors({"vocab_size": 300}) == []
