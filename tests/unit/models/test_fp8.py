"""FP8 (components/models/fp8.py): which layers become float8, the shapes refused with the layer
named, and a converted layer's output and gradients within fp8's rounding of the bf16 layer's.

The bound. e4m3 (inputs and weights, both recipes) keeps 3 mantissa bits: a value rounds by at most
2^-4 relative, 2^-4/√3 = 0.036 rms when the error spreads uniformly; a product of two rounded
operands is off by √2 × 0.036 = 0.051 rms, and a sum of many such products with independent errors
keeps that relative rms against the output's norm. The gradients also round the output gradient:
e5m2 under tensorwise (2 mantissa bits: 2^-3/√3 = 0.072 rms), so √(0.072² + 0.036²) = 0.081;
e4m3 under rowwise (0.051). The bounds are 1.5× those: 0.08 for the output, 0.12 for the gradients
(both recipes); bf16's own rounding (2^-9) is 50× smaller, so the error measured is fp8's. It must
also exceed 0.01: the layer really computed in fp8.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from components.models import build_causal_lm
from components.models.fp8 import (
    Fp8Options,
    convert_to_fp8,
    fp8_linears,
    fp8_problems,
    fp8_shape_errors,
)
from recipes.tiny_models import tiny_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def test_every_block_linear_converts_and_nothing_else():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    names = convert_to_fp8(model, Fp8Options(recipe="tensorwise", data_parallel=False))
    layers = model.config.num_hidden_layers
    assert len(names) == layers * len(PROJECTIONS)
    assert all(name.rsplit(".", 1)[1] in PROJECTIONS for name in names)
    kinds = {type(model.get_submodule(name)).__name__ for name in names}
    assert kinds == {"Float8Linear"}
    assert type(model.lm_head) is nn.Linear  # the head feeds the loss: never converted
    assert not fp8_linears(model)  # nothing plain left inside the blocks


def test_excluded_patterns_stay_plain():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    assert "model.layers.0.mlp.up_proj" not in fp8_linears(model, ("*.mlp",))
    assert "model.layers.0.self_attn.q_proj" in fp8_linears(model, ("*.mlp",))


def test_shapes_not_multiples_of_16_are_refused_with_the_layer_named():
    model = build_causal_lm(tiny_config("llama", vocab_size=96, intermediate_size=72), seed=0)
    (error,) = fp8_shape_errors(model)
    assert "model.layers.0.mlp.gate_proj has out_features=72, and 5 more layers" in error
    fits = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    assert fp8_shape_errors(fits) == []
    styles = {"model.layers.0.self_attn.k_proj": "colwise"}  # 4 kv heads of 8: 32 outputs
    (error,) = fp8_shape_errors(fits, tp=4, styles=styles)
    assert "k_proj has out_features=32 (8 per rank at tp=4)" in error


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_layer_is_within_fp8_rounding_of_bf16(recipe):
    config = tiny_config("llama", vocab_size=96, hidden_size=256, intermediate_size=512)
    model = build_causal_lm(config, seed=0)
    weight = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    convert_to_fp8(model, Fp8Options(recipe=recipe, data_parallel=False, emulate=True))  # CPU's
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))

    ours_x = x.bfloat16().requires_grad_()
    output = layer(ours_x)
    output.backward(grad.bfloat16())
    theirs_x, theirs_w = x.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    reference = F.linear(theirs_x, theirs_w)
    reference.backward(grad.bfloat16())

    errors = {
        "output": relative(output, reference),
        "input gradient": relative(ours_x.grad, theirs_x.grad),
        "weight gradient": relative(layer.weight.grad, theirs_w.grad),
    }
    print(recipe, {name: f"{error:.3f}" for name, error in errors.items()})
    assert 0.01 < errors["output"] <= 0.08
    assert 0.01 < errors["input gradient"] <= 0.12
    assert 0.01 < errors["weight gradient"] <= 0.12


def test_a_model_whose_blocks_are_not_found_is_one_refusal():
    """HRM's text model keeps its blocks outside ``model.layers`` (the coverage sweep's fp8 cell was
    a traceback in a rank): refused, naming what fp8 converts."""
    from transformers import AutoModelForCausalLM

    from tests.coverage import tiny_config as tiny_type_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_type_config("hrm_text"))
    assert fp8_problems(model, is_moe=False, lora=False, device_type="cpu") == [
        "train.precision=fp8 with HrmTextForCausalLM is not supported: fp8 converts the linears "
        "of the decoder blocks, and its blocks were not found (no model.layers); use "
        "train.precision=bf16-mixed"
    ]
