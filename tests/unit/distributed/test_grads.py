"""The grad norm's list of trainable parameters (walked at every call, nothing kept) follows the
model: freezing, thawing, replacing a parameter (as FSDP2 does, through ``_parameters``), adding and
deleting a module each change the norm; a model is freed after a norm, and a copy has its own
parameters."""

import copy
import gc
import math
import weakref

import torch
from torch import nn

from components.distributed.grads import grad_norm


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
