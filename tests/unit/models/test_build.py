"""build_causal_lm is reproducible from a seed, meta_causal_lm allocates nothing, and local bytes
count once."""

import torch

from components.models import build_causal_lm, local_parameter_bytes, meta_causal_lm
from recipes.tiny_models import tiny_config


def test_same_seed_gives_bitwise_identical_weights_and_leaves_the_global_rng_alone():
    config = tiny_config("qwen3_moe")
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first, second = build_causal_lm(config, seed=7), build_causal_lm(config, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    second_tensors = second.state_dict()
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second_tensors[name]), name
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
    other = build_causal_lm(config, seed=8)
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_meta_build_allocates_nothing():
    model = meta_causal_lm(tiny_config("mixtral"))
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert type(model).__name__ == "MixtralForCausalLM"


def test_local_parameter_bytes_counts_a_tied_parameter_once():
    untied = build_causal_lm(tiny_config("llama"), seed=0)
    tied = build_causal_lm(tiny_config("llama", tie_word_embeddings=True), seed=0)
    assert (
        local_parameter_bytes(untied)
        == 4 * sum(p.numel() for p in untied.parameters())
        == 4 * 106816
    )
    assert local_parameter_bytes(untied) - local_parameter_bytes(tied) == 4 * 256 * 64
    assert local_parameter_bytes(meta_causal_lm(tiny_config("llama"))) == local_parameter_bytes(
        untied
    )
