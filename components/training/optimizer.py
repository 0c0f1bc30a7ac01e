"""The optimizer built on a rank, and its own checks of its options, run before any rank starts.

``torch.optim`` validates its hyperparameters when it is built (``betas`` within [0, 1), a
non-negative ``weight_decay``, ...): built on a throwaway parameter here, a bad value is one
``error:`` line in the checks instead of a traceback on every rank after the folder was claimed.
"""

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from components.targets import check_target, target_class


def build_optimizer(
    target: str, params: list[torch.nn.Parameter], options: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """``target(params, **options)``, with ``foreach`` chosen where torch's default cannot work
    (:func:`foreach_choice`). Over DTensor parameters AOT autograd's cache is off first:
    torchao's low-bit optimizers compile their step, and torch 2.13 replays a cached wrapper that
    was compiled for other DTensor layouts (measured: "wrong number of dimensions" in AdamW4bit's
    step at tp=2 dp=2 once earlier runs had filled the cache), as for compiled blocks
    (components/models/compile.py)."""
    if any(isinstance(param, DTensor) for param in params):
        torch._functorch.config.enable_autograd_cache = False
    optimizer_class = target_class("optim", target, base=torch.optim.Optimizer)
    return optimizer_class(params, **options, **foreach_choice(optimizer_class, params, options))


def foreach_choice(
    optimizer_class: type, params: list[torch.nn.Parameter], options: Mapping[str, Any]
) -> dict[str, bool]:
    """``{"foreach": False}`` where the parameters mix DTensors and plain tensors (TP's sharded
    weights beside the replicas it leaves whole, without FSDP) and the user left ``foreach`` to
    torch: on CUDA torch then takes its foreach path, whose DTensor ops refuse a list holding plain
    tensors ("got mixed torch.Tensor and DTensor") at the first step; the per-tensor path computes
    the same update. Otherwise nothing (torch's default: foreach on CUDA, per tensor on the CPU)."""
    takes_foreach = "foreach" in inspect.signature(optimizer_class.__init__).parameters
    kinds = {isinstance(param, DTensor) for param in params}
    if takes_foreach and "foreach" not in options and len(kinds) == 2:
        return {"foreach": False}
    return {}


def optimizer_errors(target: str, options: Mapping[str, Any]) -> list[str]:
    """Why ``optim``'s class cannot train (not a ``torch.optim.Optimizer`` taking these options as
    keywords), or why it refuses their values."""
    errors = check_target("optim", target, options, torch.optim.Optimizer, {"params"})
    return errors or check_optimizer(target, options)


def check_optimizer(target: str, options: Mapping[str, Any]) -> list[str]:
    """Why ``target(params, **options)`` refuses its options (one line naming them), or nothing.
    ``target`` must already have passed :func:`components.targets.check_target`."""
    optimizer = target_class("optim", target, base=torch.optim.Optimizer)
    try:
        optimizer([torch.zeros(1, requires_grad=True)], **options)
    except (ValueError, TypeError) as error:
        shown = " ".join(f"optim.{key}={value}" for key, value in sorted(options.items()))
        return [f"{target} refuses {shown}: {error}; change that option"]
    return []


def optimizer_precision_errors(target: str, precision: str) -> list[str]:
    """torchao's ``_AdamW`` (``optim=adamw_bf16``) keeps its moments in the parameters' dtype: bf16
    with ``train.precision=bf16`` only; in another precision it would be AdamW in fp32, not what
    was asked."""
    if target.rpartition(".")[2] != "_AdamW" or precision == "bf16":
        return []
    return [
        f"{target} keeps its state in the parameters' dtype, bf16 with train.precision=bf16 only "
        f"(got train.precision={precision}): add train.precision=bf16"
    ]
