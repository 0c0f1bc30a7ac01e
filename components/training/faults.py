"""Deliberate faults, switched on by ``debug.fault``, so tests can prove the safeguards catch them.

- ``nan_grad@N``: after the backward of step N, rank 0 writes NaN into one gradient (a numerical blow-up).
- ``perturb_replica@N``: after the update of step N, the last rank nudges its copy of one TP-replicated
  parameter (replica drift, as a non-deterministic kernel or a missed sync would cause).
- ``raise@N``: the last rank raises at the start of step N (a crash on one rank mid-run).
- ``replica_sync_sum``: every replicated parameter is sum-reduced instead of mean-reduced (the classic
  mean-vs-sum bug: redundant gradients counted tp times).
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.distributed.tp_replicas import (
    _TP_REPLICA_GRAD_REDUCTION_ATTR,
    _unmarked_entries_by_name,
    mark_tp_replica_gradient_reduction,
)

KINDS = ("nan_grad", "perturb_replica", "raise", "replica_sync_sum")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None = None


def parse_fault(text: str | None) -> Fault | None:
    """``"nan_grad@3"`` -> Fault("nan_grad", 3); None -> None; anything else -> ValueError naming the key."""
    if text is None:
        return None
    kind, _, step = str(text).partition("@")
    needs_step = kind in ("nan_grad", "perturb_replica", "raise")
    if kind not in KINDS or needs_step != step.isdigit() or (step.isdigit() and int(step) < 1):
        raise ValueError(
            f"debug.fault {text!r} is not a known fault: use nan_grad@STEP, perturb_replica@STEP, raise@STEP "
            "or replica_sync_sum"
        )
    return Fault(kind, int(step) if step else None)


def break_replica_sync(model: nn.Module) -> None:
    """``replica_sync_sum``: mark every module whose parameters are synchronised as ``sum``."""
    for module in model.modules():
        if getattr(module, _TP_REPLICA_GRAD_REDUCTION_ATTR, "mean") != "skip":
            mark_tp_replica_gradient_reduction(module, "sum")


def _first_plain(model: nn.Module, with_grad: bool) -> torch.Tensor:
    for _, parameter, _ in _unmarked_entries_by_name([model]):
        if not isinstance(parameter, DTensor) and (parameter.grad is not None or not with_grad):
            return parameter
    raise RuntimeError("no plain replicated parameter to inject a fault into")


def inject_at_step_start(fault: Fault | None, step: int, rank: int, world_size: int) -> None:
    if fault is not None and fault.kind == "raise" and fault.step == step and rank == world_size - 1:
        raise RuntimeError(f"injected fault (debug.fault=raise@{step})")


@torch.no_grad()
def inject_after_backward(fault: Fault | None, model: nn.Module, step: int, rank: int) -> None:
    if fault is not None and fault.kind == "nan_grad" and fault.step == step and rank == 0:
        _first_plain(model, with_grad=True).grad.view(-1)[0] = float("nan")


@torch.no_grad()
def inject_after_update(fault: Fault | None, model: nn.Module, step: int, rank: int, world_size: int) -> None:
    if fault is not None and fault.kind == "perturb_replica" and fault.step == step and rank == world_size - 1:
        _first_plain(model, with_grad=False).view(-1)[0] += 1e-3
