"""Model FLOPs per token from a Hugging Face config, for ``tflops`` and ``mfu``.

The convention (PaLM's; torchtitan, Megatron and AutoModel report MFU against it): forward plus
backward is 3 × the forward's matmuls (backward computes the gradients of the input and of the
weight), so every matmul parameter costs 6 FLOPs per token, ``lm_head`` included (the embedding is
a lookup, not a matmul). Attention at sequence length ``s`` adds, per layer, q·kᵀ and p·v: 2 × 2 ×
s × heads × head_dim per token forward, 12 × ... forward and backward. No causal halving (a causal
kernel skips about half of the score matrix; the convention counts all of it, as
``FlopCounterMode`` does), and no activation-checkpointing recompute (MFU counts the model's work,
not the recipe's). An MoE layer counts its router and only the ``num_experts_per_tok`` experts each
token is routed to (plus a shared expert where the config has one). Norms, rotary and elementwise
work are left out (well under 1%).
"""

from typing import Any

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched against torch.cuda.get_device_name.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),  # before "H100": the SXM part's is 989
    ("A100", 312.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)
# The same parts' dense TF32 tensor-core peaks (half the bf16 ones) and plain fp32 (CUDA cores).
PEAK_TF32_TFLOPS = tuple((name, peak / 2) for name, peak in PEAK_BF16_TFLOPS)
PEAK_FP32_TFLOPS = (
    ("H100 PCIe", 51.0),
    ("A100", 19.5),
    ("H100", 67.0),
    ("H200", 67.0),
    ("B200", 75.0),
)
PEAKS = {"bf16": PEAK_BF16_TFLOPS, "tf32": PEAK_TF32_TFLOPS, "fp32": PEAK_FP32_TFLOPS}


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def head_dim(config: Any) -> int:
    return _get(config, "head_dim", default=config.hidden_size // config.num_attention_heads)


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return int(_get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether decoder layer ``index`` has an MoE block (Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step`` keep some layers dense; Mixtral's are all sparse)."""
    if num_experts(config) == 0 or index in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index + 1) % step == 0


def attention_matmul_params(config: Any) -> int:
    """q, k, v and o projections of one layer."""
    hidden, dim = config.hidden_size, head_dim(config)
    heads = config.num_attention_heads
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    return hidden * dim * (2 * heads + 2 * kv_heads)


def mlp_matmul_params(config: Any, index: int, active: bool = True) -> int:
    """The gated MLP of layer ``index`` (gate, up, down): dense, or the MoE block's router plus its
    experts (``active``: only the ``num_experts_per_tok`` a token visits; else all of them)."""
    hidden = config.hidden_size
    if not is_sparse_layer(config, index):
        size = config.intermediate_size  # Gemma 3n's: one per layer
        return 3 * hidden * (size[index] if isinstance(size, list | tuple) else size)
    expert = 3 * hidden * _get(config, "moe_intermediate_size", "intermediate_size")
    experts = num_experts(config)
    used = _get(config, "num_experts_per_tok", default=experts) if active else experts
    shared = 3 * hidden * (getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return hidden * experts + used * expert + shared


def matmul_params_per_token(config: Any) -> int:
    """Matmul parameters one token passes through: every layer's projections (the active experts of
    an MoE layer) and ``lm_head``."""
    layers = range(config.num_hidden_layers)
    blocks = sum(attention_matmul_params(config) + mlp_matmul_params(config, i) for i in layers)
    return blocks + config.hidden_size * config.vocab_size


def attention_flops_per_token(config: Any, seq_len: int) -> int:
    """Score and value matmuls at ``seq_len``, forward and backward:
    12 × layers × heads × head_dim × s."""
    return 12 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * seq_len


def flops_per_token(config: Any, seq_len: int) -> int:
    """Model FLOPs of forward + backward per token at ``seq_len`` (see the module docstring); a
    composite config (an image-text model's) counts its text model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return 6 * matmul_params_per_token(config) + attention_flops_per_token(config, seq_len)


def known_flops_per_token(config: Any, seq_len: int) -> int | None:
    """:func:`flops_per_token`, or None where the config lacks a size the count reads (GPT-2's
    MLP width is ``n_inner=None``, Mamba has no attention heads): throughput then has no TFLOP/s."""
    try:
        return flops_per_token(config, seq_len)
    except (AttributeError, TypeError):
        return None


def peak_tflops(device: torch.device | str, math: str = "bf16") -> float | None:
    """The device's dense peak for the matmuls' ``math`` (``bf16``, ``tf32`` or ``fp32``:
    :data:`PEAKS`); None on the CPU or another GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAKS[math] if key in name), None)
