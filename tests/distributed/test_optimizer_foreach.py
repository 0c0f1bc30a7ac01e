"""The optimizer at tp=2 without FSDP, on torch's CUDA default path, simulated on the CPU: there
``torch.optim`` takes its foreach path, whose DTensor ops refuse a list that mixes the sharded
weights (DTensors) with the replicas TP leaves whole (plain tensors), so the recipe's
``build_optimizer`` chooses the per-tensor path for such a list (the same update). A rank lists
the CPU among the foreach devices, as the CUDA build does for CUDA tensors, then steps AdamW and
SGD built by torch's default and by ``build_optimizer``.
"""

import functools
import importlib

import pytest
import torch
from torch.distributed.tensor import DTensor

from components.distributed.tp_plan import apply_tp_plan
from components.models import build_causal_lm
from components.models.families import plan_for
from components.training.optimizer import build_optimizer
from recipes.tiny_models import tiny_config
from tests.harness import mesh

OPTIMIZERS = {"torch.optim.AdamW": {"lr": 1e-3}, "torch.optim.SGD": {"lr": 0.1}}
TORCH_CLASSES = {"torch.optim.AdamW": torch.optim.AdamW, "torch.optim.SGD": torch.optim.SGD}


def _step(optimizer_of, world_size: int) -> str:
    """One step of the optimizer ``optimizer_of(params)`` over a tp=``world_size`` Llama: ``ok``
    or the error's first line."""
    config = tiny_config("llama")
    model = build_causal_lm(config, seed=0)
    apply_tp_plan(model, mesh((world_size,), ("tp",)), plan_for(config, False), config, False)
    params = list(model.parameters())
    assert {isinstance(p, DTensor) for p in params} == {True, False}  # the mixed list
    for param in params:
        param.grad = torch.ones_like(param)
    try:
        optimizer_of(params).step()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "ok"


def check_steps_on_the_cuda_default_path(rank, world_size):
    torch_optimizer = importlib.import_module("torch.optim.optimizer")
    torch_optimizer._get_foreach_kernels_supported_devices = lambda: ["cuda", "cpu"]
    results = {}
    for target, options in OPTIMIZERS.items():
        default = functools.partial(TORCH_CLASSES[target], **options)
        ours = functools.partial(build_optimizer, target, options=options)
        results[target] = (_step(default, world_size), _step(ours, world_size))
    return results


def test_build_optimizer_steps_a_mixed_list_where_torchs_cuda_default_fails(ranks2):
    for results in ranks2.run(check_steps_on_the_cuda_default_path, timeout_s=120):
        for target, (default, ours) in results.items():
            assert "got mixed torch.Tensor and DTensor" in default, target
            assert ours == "ok", target


@pytest.mark.parametrize("target", OPTIMIZERS)
def test_a_foreach_the_user_sets_is_kept(target):
    params = [torch.nn.Parameter(torch.ones(2))]
    assert build_optimizer(target, params, {"lr": 0.1, "foreach": True}).defaults["foreach"]
    assert build_optimizer(target, params, {"lr": 0.1}).defaults["foreach"] is None
