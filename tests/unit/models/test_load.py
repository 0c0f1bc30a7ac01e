"""load_config and materialize_pretrained on one process (plain tensors): same logits as
from_pretrained.

Sharded (DTensor) loading on real ranks is in tests/distributed/test_model_loading.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3nTextConfig, LlamaConfig

from components.models import (
    build_causal_lm,
    load_config,
    materialize_pretrained,
    meta_causal_lm,
)
from components.models.build import materialize_random
from recipes.tiny_models import tiny_config

SMALL_GEMMA3N = dict(
    hidden_size=64,
    intermediate_size=[128, 128],
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=16,
    num_kv_shared_layers=0,
    layer_types=["sliding_attention", "full_attention"],
    activation_sparsity_pattern=[0.95, 0.0],
)
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def save_tiny(folder: Path, family: str = "llama", **save_kwargs) -> Path:
    """A seeded tiny model of ``family`` saved with ``save_pretrained``."""
    overrides = save_kwargs.pop("overrides", {})
    build_causal_lm(tiny_config(family, **overrides), seed=11).save_pretrained(
        folder, **save_kwargs
    )
    return folder


def loaded(folder: Path) -> nn.Module:
    model = meta_causal_lm(load_config(folder))
    materialize_pretrained(model, folder)
    return model


def assert_same_as_from_pretrained(model: nn.Module, folder: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config._attn_implementation == reference.config._attn_implementation
    reference_tensors = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert tensor.device.type == "cpu" and torch.equal(tensor, reference_tensors[name]), name
    assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)


# --- load_config ---------------------------------------------------------------------------------


def test_load_config_reads_a_local_folder(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    config = load_config(str(tmp_path))
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("qwen3", 64, 4)


def test_load_config_names_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model folder {tmp_path / 'nope'} does not exist"):
        load_config(tmp_path / "nope")


def test_load_config_names_a_folder_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model folder {tmp_path} has no config.json"):
        load_config(tmp_path)


# --- same weights, buffers and logits as from_pretrained ------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_meta_model_loads_like_from_pretrained(tmp_path, family):
    folder = save_tiny(tmp_path, family)
    model = loaded(folder)
    assert_same_as_from_pretrained(model, folder)
    # recomputed after to_empty: the rotary frequencies of the config, not garbage
    rotary = model.model.rotary_emb
    expected, _ = rotary.compute_default_rope_parameters(model.config)
    assert torch.equal(rotary.inv_freq, expected) and torch.equal(
        rotary.original_inv_freq, expected
    )


def test_buffers_are_recomputed_by_the_init_weights_of_the_model_holding_them(tmp_path):
    # Gemma 3n's text model initialises its scales from its own hidden_size, which the causal LM
    # around it lacks: transformers calls the innermost pretrained model's _init_weights
    config = Gemma3nTextConfig(**SMALL_GEMMA3N)
    build_causal_lm(config, seed=11).save_pretrained(tmp_path)
    model = loaded(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, buffer in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name


def test_buffers_an_ancestors_init_weights_sets_are_recomputed(tmp_path):
    # Falcon-H1's model, not its Mamba mixer, sets each mixer's mup_vector
    from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
    from tests.coverage import save_tiny_model

    tokenizer = train_tokenizer(["hello world"], DEFAULT_VOCAB_SIZE, tmp_path / "tokenizer")
    save_tiny_model("falcon_h1", tmp_path / "model", tokenizer)
    model = loaded(tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert torch.equal(
        model.model.layers[1].mamba.mup_vector, reference.model.layers[1].mamba.mup_vector
    )
    for name, buffer in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name


def test_moe_checkpoints_store_one_tensor_per_expert_and_fused_ones_load_too(tmp_path):
    # transformers 5 fuses experts in memory but save_pretrained writes them per expert (Mixtral
    # renamed).
    folder = save_tiny(tmp_path / "per_expert", "mixtral")
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    # a checkpoint in the model's own (fused) names loads as well
    model = build_causal_lm(tiny_config("mixtral"), seed=3)
    fused = tmp_path / "fused"
    model.config.save_pretrained(fused)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors"
    )
    assert torch.equal(loaded(fused)(TOKENS).logits, model(TOKENS).logits)


def test_sharded_checkpoint_with_an_index(tmp_path):
    folder = save_tiny(tmp_path, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file() and not (
        folder / "model.safetensors"
    ).exists()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert_same_as_from_pretrained(loaded(folder), folder)


def test_tied_embeddings_stay_one_parameter(tmp_path):
    folder = save_tiny(tmp_path, overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # as in SmolLM2
    model = loaded(folder)
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight
    )  # to_empty alone would untie them
    assert_same_as_from_pretrained(model, folder)


def test_a_tie_broken_before_loading_fills_both_copies_from_the_stored_tensor(tmp_path):
    folder = save_tiny(tmp_path, overrides={"tie_word_embeddings": True})
    model = meta_causal_lm(load_config(folder))
    model.lm_head.weight = nn.Parameter(
        torch.empty(256, 64, device="meta")
    )  # as a TP plan untying them would
    materialize_pretrained(model, folder)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(
        model.lm_head.weight, load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    )


# --- errors, raised before the model is touched
# ----------------------------------------------------


def drop_key(folder: Path, key: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_parameter_is_a_key_error_naming_it(tmp_path):
    folder = save_tiny(tmp_path)
    drop_key(folder, "model.layers.1.post_attention_layernorm.weight")
    model = meta_causal_lm(load_config(folder))
    with pytest.raises(
        KeyError,
        match=r"model\.layers\.1\.post_attention_layernorm\.weight is not in the checkpoint",
    ):
        materialize_pretrained(model, folder)
    assert all(p.is_meta for p in model.parameters())


def test_an_untied_lm_head_never_falls_back_to_the_embedding(tmp_path):
    folder = save_tiny(tmp_path)
    drop_key(folder, "lm_head.weight")
    with pytest.raises(KeyError, match=r"lm_head\.weight is not in the checkpoint"):
        loaded(folder)


def test_missing_expert_names_the_fused_parameter_and_the_per_expert_keys(tmp_path):
    folder = save_tiny(tmp_path, "qwen3_moe")
    drop_key(folder, "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(
        KeyError,
        match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: .* holds 8 of "
        r"mlp\.experts\.\*\.gate_proj\.weight but 7 of mlp\.experts\.\*\.up_proj\.weight",
    ):
        loaded(folder)


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    folder = save_tiny(tmp_path)
    model = meta_causal_lm(tiny_config("llama", intermediate_size=96))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.gate_proj\.weight: checkpoint shape \(128, 64\) "
        r".* model shape \(96, 64\)",
    ):
        materialize_pretrained(model, folder)


def test_folder_without_safetensors_is_a_file_not_found_error(tmp_path):
    LlamaConfig().save_pretrained(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=f"no model.safetensors or model.safetensors.index.json in {tmp_path}",
    ):
        materialize_pretrained(meta_causal_lm(tiny_config("llama")), tmp_path)


def test_a_non_persistent_buffer_that_init_weights_does_not_set_is_an_error(tmp_path):
    folder = save_tiny(tmp_path)
    model = meta_causal_lm(load_config(folder))
    model.model.layers[0].register_buffer(
        "scratch", torch.empty(3, device="meta"), persistent=False
    )
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.scratch is not in the checkpoint and _init_weights"
    ):
        materialize_pretrained(model, folder)


def test_llama_checkpoint_names_are_the_state_dict_names(tmp_path):
    folder = save_tiny(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(build_causal_lm(tiny_config("llama"), seed=0).state_dict())


# --- dtypes
# ------------------------------------------------------------------------------------------


def test_a_bf16_checkpoint_gives_fp32_master_weights_equal_to_its_values(tmp_path):
    build_causal_lm(tiny_config("llama"), seed=11, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = meta_causal_lm(load_config(tmp_path), dtype=torch.float32)
    materialize_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and torch.equal(parameter, stored[name].float()), (
            name
        )


def test_a_bf16_model_loads_an_fp32_checkpoint_rounded(tmp_path):
    save_tiny(tmp_path)
    model = meta_causal_lm(load_config(tmp_path), dtype=torch.bfloat16)
    materialize_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.bfloat16 and torch.equal(
            parameter, stored[name].bfloat16()
        ), name


# --- materialize_random (no checkpoint: benchmarks of real-size shapes)
# --------------------------------


def test_materialize_random_gives_every_tensor_storage_and_the_right_buffers():
    config = tiny_config("llama")
    model = meta_causal_lm(config, dtype=torch.bfloat16)
    materialize_random(model, seed=0)
    reference = build_causal_lm(config, seed=0)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    for name, parameter in model.named_parameters():
        assert parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16, name
        if parameter.dim() == 1:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        else:
            assert 0.015 < parameter.float().std().item() < 0.025, name
    assert torch.isfinite(model(TOKENS).logits).all()
