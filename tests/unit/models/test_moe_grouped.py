"""Grouped GEMM experts (``torch._grouped_mm``) against the per-expert loop they replace.

fp32: outputs and every gradient (rows, both expert weights, routing weights) agree to 1e-6
relative, experts that receive no rows get exact zero gradients on both paths, with per-expert
LoRA adapters too. bf16 (pure, and
autocast on fp32 weights) agrees within a bf16 band. Where grouped GEMM cannot run (fp64,
unaligned sizes) the loop runs. GPT-OSS's experts (transposed, biased, a clamped SwiGLU of
interleaved rows) give its own module's outputs and gradients on both paths."""

import pytest
import torch
from transformers import GptOssConfig

from components.models import build_causal_lm
from components.moe.expert_compute import (
    grouped_mm_fits,
    run_experts,
    run_experts_grouped,
    run_experts_loop,
)
from components.moe.expert_lora import LowRank
from recipes.tiny_models import tiny_config

IDLE = (1, 5)  # local experts that receive no rows
GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=64,
)


def experts_module(family="qwen3_moe"):
    return build_causal_lm(tiny_config(family), seed=0).model.layers[0].mlp.experts


def inputs(experts, rows=96, dtype=torch.float32, weights_dtype=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    count, _, hidden = experts.gate_up_proj.shape
    busy = torch.tensor([e for e in range(count) if e not in IDLE])
    expert_of_row = busy[torch.randint(len(busy), (rows,), generator=generator)]
    weights_dtype = weights_dtype or dtype

    def leaf(*shape, dtype=dtype, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).requires_grad_()

    gate_up = leaf(*experts.gate_up_proj.shape, dtype=weights_dtype, scale=0.1)
    down = leaf(*experts.down_proj.shape, dtype=weights_dtype, scale=0.1)
    return (
        leaf(rows, hidden),
        expert_of_row,
        gate_up,
        down,
        leaf(rows).detach().abs().requires_grad_(),
    )


def run(function, experts, rows, expert_of_row, gate_up, down, weight_of_row, autocast=False):
    leaves = (rows, gate_up, down, weight_of_row)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = function(experts, rows, expert_of_row, gate_up, down, weight_of_row)
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    gradients = torch.autograd.grad((output.float() * upstream).sum(), leaves, allow_unused=True)
    return output.detach(), gradients


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_matches_the_loop_in_fp32_idle_experts_included(family):
    experts = experts_module(family)
    args = inputs(experts)
    assert grouped_mm_fits(args[0], args[2], args[3])
    grouped, grouped_gradients = run(run_experts_grouped, experts, *args)
    loop, loop_gradients = run(run_experts_loop, experts, *args)
    assert relative(grouped, loop) <= 1e-6
    names = ("rows", "gate_up", "down", "weights")
    for name, g, ref in zip(names, grouped_gradients, loop_gradients, strict=True):
        assert relative(g, ref) <= 1e-6, name
    for gradient in (
        grouped_gradients[1],
        grouped_gradients[2],
        loop_gradients[1],
        loop_gradients[2],
    ):
        assert gradient[list(IDLE)].abs().max() == 0  # zero, not missing
        assert gradient[[e for e in range(len(gradient)) if e not in IDLE]].abs().min() > 0


def test_grouped_matches_the_loop_without_routing_weights():
    # The all-to-all path weights the results after sending them back.
    experts = experts_module()
    rows, expert_of_row, gate_up, down, _ = inputs(experts)
    grouped = run_experts_grouped(experts, rows, expert_of_row, gate_up, down)
    loop = run_experts_loop(experts, rows, expert_of_row, gate_up, down)
    assert relative(grouped, loop) <= 1e-6


@pytest.mark.parametrize(
    ("dtype", "weights_dtype", "autocast"),
    [
        (torch.bfloat16, torch.bfloat16, False),  # bf16: everything in bf16
        (
            torch.float32,
            torch.float32,
            True,
        ),  # bf16-mixed: fp32 weights, matmuls in bf16 under autocast
    ],
)
def test_grouped_matches_the_loop_in_bf16(dtype, weights_dtype, autocast):
    experts = experts_module()
    args = inputs(experts, dtype=dtype, weights_dtype=weights_dtype)
    grouped, grouped_gradients = run(run_experts_grouped, experts, *args, autocast=autocast)
    loop, loop_gradients = run(run_experts_loop, experts, *args, autocast=autocast)
    assert grouped.dtype == loop.dtype == dtype
    assert relative(grouped, loop) <= 2e-2
    for g, ref in zip(grouped_gradients, loop_gradients, strict=True):
        assert g.dtype == ref.dtype
        assert relative(g, ref) <= 2e-2
    for gradient in grouped_gradients[1:3]:
        assert gradient[list(IDLE)].abs().max() == 0


def test_no_rows_still_gives_every_weight_a_zero_gradient():
    experts = experts_module()
    rows, expert_of_row, gate_up, down, weights = inputs(experts, rows=0)
    output, gradients = run(run_experts, experts, rows, expert_of_row, gate_up, down, weights)
    assert output.shape == rows.shape
    assert gradients[1].abs().max() == 0 and gradients[2].abs().max() == 0


def test_the_loop_runs_where_grouped_gemm_cannot():
    experts = experts_module()
    rows, expert_of_row, gate_up, down, weights = inputs(experts, dtype=torch.float64)
    assert not grouped_mm_fits(rows, gate_up, down)  # _grouped_mm takes fp32, bf16 and fp16 only
    expected = run_experts_loop(experts, rows, expert_of_row, gate_up, down, weights)
    assert torch.equal(run_experts(experts, rows, expert_of_row, gate_up, down, weights), expected)
    rows, expert_of_row, gate_up, down, _ = inputs(experts)
    # H, then I, not a multiple of 16 bytes
    assert not grouped_mm_fits(rows[:, :-1], gate_up[..., :-1], down)
    assert not grouped_mm_fits(rows.bfloat16(), gate_up.bfloat16(), down.bfloat16()[..., :60])


def test_grouped_matches_the_loop_with_per_expert_adapters():
    experts = experts_module()
    rows, expert_of_row, gate_up, down, weight_of_row = inputs(experts)
    generator = torch.Generator().manual_seed(2)
    count, rank = gate_up.shape[0], 4

    def leaf(*shape):
        return (torch.randn(*shape, generator=generator) * 0.1).requires_grad_()

    adapters = [leaf(count, rank, w.shape[2]) for w in (gate_up, down)]  # A [E, r, in]
    adapters += [leaf(count, w.shape[1], rank) for w in (gate_up, down)]  # B [E, out, r]
    low_rank = LowRank(
        gate_up=(adapters[0], adapters[2]), down=(adapters[1], adapters[3]), scaling=2.0
    )
    assert grouped_mm_fits(rows, gate_up, down, low_rank)
    results = []
    for function in (run_experts_grouped, run_experts_loop):
        output = function(experts, rows, expert_of_row, gate_up, down, weight_of_row, low_rank)
        upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
        results.append((output, torch.autograd.grad((output * upstream).sum(), [rows, *adapters])))
    (grouped, grouped_gradients), (loop, loop_gradients) = results
    assert relative(grouped, loop) <= 1e-6
    assert relative(grouped, run_experts(experts, rows, expert_of_row, gate_up, down)) > 1e-3
    for g, ref in zip(grouped_gradients, loop_gradients, strict=True):
        assert relative(g, ref) <= 1e-6
    for gradient in grouped_gradients[1:]:  # A and B of both weights
        assert gradient[list(IDLE)].abs().max() == 0 and gradient.abs().max() > 0


@pytest.mark.parametrize("path", [run_experts_grouped, run_experts_loop])
def test_gpt_oss_experts_biases_and_clamped_swiglu_are_its_own(path):
    # Transposed weights, per-expert biases, interleaved gate/up rows and a SwiGLU clamped at a
    # limit the rows reach: the module's own forward is the reference, gradients included.
    config = GptOssConfig(**GPT_OSS, num_local_experts=8, swiglu_limit=0.5)
    experts = build_causal_lm(config, seed=0).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 64, generator=generator).requires_grad_()
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=generator).requires_grad_()
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0, 0.3, generator=generator)
    leaves = (hidden, weights, *experts.parameters())
    expected = experts(hidden, index, weights)
    token, slot = torch.where(index >= 0)
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias)
    rows = path(
        experts,
        hidden[token],
        index[token, slot],
        experts.gate_up_proj,
        experts.down_proj,
        weights[token, slot],
        None,  # no adapters
        biases,
    )
    output = torch.zeros_like(hidden).index_add(0, token, rows)
    assert relative(output.detach(), expected.detach()) <= 1e-6
    upstream = torch.randn(expected.shape, generator=generator)
    ours = torch.autograd.grad((output * upstream).sum(), leaves)
    theirs = torch.autograd.grad((expected * upstream).sum(), leaves)
    for g, ref in zip(ours, theirs, strict=True):
        assert relative(g, ref) <= 1e-5
