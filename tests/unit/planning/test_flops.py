"""flops_per_token against torch's FlopCounterMode on a real forward + backward of the tiny models.

Like with like: FlopCounterMode counts matmuls (mm, bmm, addmm) and the CUDA sdpa kernels, but on
the CPU sdpa runs ``_scaled_dot_product_flash_attention_for_cpu``, which it does not count at all,
and the MoE experts run ``_grouped_mm``, which it does not count either. So the main check builds
the models with eager attention (q·kᵀ and p·v as bmm over the full s × s scores with an additive
causal mask: full attention, no causal halving, as the convention) and eager experts (one F.linear
per routed expert), and every FLOP of the convention becomes a counted matmul. The second check
runs the recipe's sdpa path with torch's own sdpa formulas registered for the CPU kernel: they
count full attention too (torch notes "we aren't accounting for causal attention"), and the
backward adds the flash kernel's recompute of the scores, 7 matmuls where the convention's backward
has 4 + 2 forward: attention counts 7/6 of ours.
"""

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from components.models import build_causal_lm, meta_causal_lm
from components.models.configs import build_config
from components.planning.flops import attention_flops_per_token, flops_per_token, peak_tflops
from components.training.metrics import throughput
from recipes.tiny_models import tiny_config

SEQ_LEN = 256  # the tiny models' longest: attention is 40% of the FLOPs here
BATCH = 2
TINY_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
LLAMA_3_70B = dict(
    hidden_size=8192,
    num_hidden_layers=80,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    head_dim=128,
    max_position_embeddings=8192,
)


def _counted_flops_per_token(config, mapping=None) -> float:
    model = build_causal_lm(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    counter = FlopCounterMode(display=False, custom_mapping=mapping or {})
    with counter:
        model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    return counter.get_total_flops() / (BATCH * SEQ_LEN)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_flops_per_token_matches_the_flop_counter_on_eager_attention_and_experts(family):
    config = tiny_config(family, attn_implementation="eager")
    config._experts_implementation = "eager"  # one counted F.linear per routed expert
    predicted = flops_per_token(config, SEQ_LEN)
    assert attention_flops_per_token(config, SEQ_LEN) > 0.3 * predicted  # attention matters here
    counted = _counted_flops_per_token(config)
    assert counted == pytest.approx(predicted, rel=0.05), (family, counted, predicted)


def _as_many_heads(q, *kv):
    """Key/value shapes with the query's heads: torch 2.11's formulas refuse GQA shapes (2.13's
    take them); the count is the same."""
    return [torch.Size((shape[0], q[1], *shape[2:])) for shape in kv]


def _sdpa_backward(grad, q, k, v, *_, **__):
    return flop_counter.sdpa_backward_flop_count(grad, q, *_as_many_heads(q, k, v))


def test_the_sdpa_path_counts_full_attention_plus_the_backward_recompute():
    aten = torch.ops.aten
    cpu_flash = aten._scaled_dot_product_flash_attention_for_cpu
    mapping = {  # torch's own formulas for the CUDA kernels, on the CPU kernel's (shape) arguments
        cpu_flash: lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(
            q, *_as_many_heads(q, k, v)
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    }
    config = tiny_config("llama")  # the recipe's sdpa attention
    attention = attention_flops_per_token(config, SEQ_LEN)
    dense = flops_per_token(config, SEQ_LEN) - attention
    counted = _counted_flops_per_token(config, mapping)  # the counter hands them shapes
    assert counted == pytest.approx(dense + attention * 7 / 6, rel=0.01)


def test_throughput_is_model_tflops_per_rank_and_mfu_only_where_the_peak_is_known(monkeypatch):
    record = throughput(tokens=4_000, seconds=2.0, flops=1e12, world=4, device=torch.device("cpu"))
    assert record == {"tokens_per_s": 2_000.0, "tflops": 500.0}  # 1e12 × 4000 / 2 s / 4 ranks
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_tflops("cuda:0") == 989.0
    mfu = throughput(4_000, 2.0, 1e12, 4, torch.device("cuda:0"))["mfu"]
    assert mfu == pytest.approx(500 / 989)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_tflops("cuda:0") == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert "mfu" not in throughput(4_000, 2.0, 1e12, 4, torch.device("cuda:0"))


def test_llama_3_70b_is_the_standard_formula():
    config = build_config("llama", LLAMA_3_70B)
    params = sum(p.numel() for p in meta_causal_lm(config).parameters())
    assert params == pytest.approx(70.55e9, rel=1e-3)
    non_embedding = params - config.vocab_size * config.hidden_size  # lm_head is a matmul
    standard = 6 * non_embedding + 12 * 80 * 64 * 128 * 8192
    assert flops_per_token(config, 8192) == pytest.approx(standard, rel=1e-3)


def test_a_composite_config_counts_its_text_model_and_per_layer_mlp_sizes():
    from transformers import Gemma3Config, Gemma3nTextConfig, Gemma3TextConfig

    text = Gemma3TextConfig(**TINY_TEXT, intermediate_size=128)
    composite = Gemma3Config(text_config=text.to_dict())
    assert flops_per_token(composite, 32) == flops_per_token(text, 32)
    sizes = [[128, 256], [128, 128], [256, 256]]  # Gemma 3n: one MLP size per layer
    per_layer, *even = [Gemma3nTextConfig(**TINY_TEXT, intermediate_size=s) for s in sizes]
    assert flops_per_token(per_layer, 32) * 2 == sum(flops_per_token(c, 32) for c in even)


def test_a_config_without_the_sizes_the_count_reads_has_no_flops_and_no_tflops():
    from transformers import GPT2Config, MambaConfig

    from components.planning.flops import known_flops_per_token

    for config in (GPT2Config(n_inner=None), MambaConfig()):  # MLP width 4h implied; no heads
        assert known_flops_per_token(config, 32) is None
    assert throughput(1000, 2.0, None, 2, "cpu") == {"tokens_per_s": 500.0}
