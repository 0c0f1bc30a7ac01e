"""The grad norm's list of trainable parameters (walked at every call, nothing kept) follows the
model: freezing, thawing, replacing a parameter (as FSDP2 does, through ``_parameters``), adding and
deleting a module each change the norm; a model is freed after a norm, and a copy has its own
parameters. The 2-norm's float64 sum of squares is exact across chunks, dtypes and strides."""

import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

from components.distributed import grads as grads_module
from components.distributed.grads import float64_sum_of_squares, grad_norm


def with_grads(model: nn.Module) -> nn.Module:
    for index, parameter in enumerate(model.parameters()):
        parameter.grad = torch.full_like(parameter, float(index + 1))
    return model


def expected(model: nn.Module) -> float:
    return math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.requires_grad)
    )


def test_the_trainable_parameters_follow_every_change_to_the_model():
    torch.manual_seed(0)
    model = with_grads(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    replacement = nn.Parameter(torch.zeros(2))
    replacement.grad = torch.full((2,), 7.0)
    checks = [
        lambda: None,
        lambda: model[0].weight.requires_grad_(False),  # frozen
        lambda: model[0].weight.requires_grad_(True),  # thawed
        lambda: model[1]._parameters.__setitem__("bias", replacement),  # replaced
        lambda: model.append(with_grads(nn.Linear(2, 2))),  # a module added
        lambda: model.__delitem__(0),  # a module deleted
    ]
    for change in checks:
        change()
        assert grad_norm([model]).item() == expected(model)


def test_a_norm_keeps_nothing_of_the_model_and_a_copy_is_its_own():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    model.register_forward_pre_hook(
        lambda module, args, root=model: None
    )  # references its root, as FSDP2's do
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    assert grad_norm([model]).item() == math.sqrt(18)
    twin = copy.deepcopy(model)
    for parameter in twin.parameters():
        parameter.grad = torch.ones_like(parameter)
    twin[1].weight.requires_grad_(False)  # the copy's own list, not the original's
    assert grad_norm([twin]).item() == math.sqrt(15)
    assert grad_norm([model]).item() == math.sqrt(18)
    gone = weakref.ref(model)
    del model, twin
    gc.collect()
    assert gone() is None


def test_the_2_norm_sums_exact_float64_squares_across_chunks_dtypes_and_strides(monkeypatch):
    """Chunks of 7 elements (so tensors cross chunk ends), fp32, bf16 and a transposed (not
    contiguous) gradient, against a float64 reference within 1e-14; integers exactly."""
    monkeypatch.setattr(grads_module, "SQUARES_CHUNK", 7)
    generator = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.a = nn.Linear(5, 3)  # weight 15 elements: chunks of 7, 7, 1
    model.b = nn.Linear(4, 4, dtype=torch.bfloat16)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
    model.b.weight.grad = model.b.weight.grad.t()  # a transposed view: the per-tensor path
    assert not model.b.weight.grad.is_contiguous()
    reference = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert grad_norm([model]).item() == pytest.approx(reference, rel=1e-14)
    for index, parameter in enumerate(model.parameters()):
        parameter.grad = torch.full_like(parameter, float(index + 1))
    assert grad_norm([model]).item() == expected(model)
    assert float64_sum_of_squares([torch.full((20,), 3.0)]).item() == 180.0
