"""Deliberate faults, switched on by ``debug.fault``, so tests can prove the safeguards catch them.

- ``nan_grad@N``: after the backward of step N, rank 0 writes NaN into one gradient.
- ``perturb_replica@N``: after the update of step N, the last rank nudges its copy of one
  TP-replicated parameter (replica drift).
- ``raise@N``: the last rank raises at the start of step N (a crash on one rank mid-run).
- ``replica_sync_sum``: every replicated parameter is sum-reduced instead of mean-reduced.
- ``slow_save@S``: every checkpoint save waits S seconds before it is committed, so a test can kill
  a run in the middle of a save.

:func:`install_faults` installs a fault once, through hooks: the training loop holds no test
machinery. Steps count the model's training forward passes, so a skipped update does not shift them.

Design notes: docs/design-notes.md
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.distributed.tp_replicas import (
    mark_tp_replica_gradient_reduction,
    tp_replica_reduction,
    unmarked_parameters,
)

KINDS = ("nan_grad", "perturb_replica", "raise", "replica_sync_sum", "slow_save")
_WITH_STEP = ("nan_grad", "perturb_replica", "raise", "slow_save")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    step: int | None = None  # the step it strikes at (seconds for slow_save)


def parse_fault(text: str | None) -> Fault | None:
    """``"nan_grad@3"`` -> Fault("nan_grad", 3); None -> None; anything else -> ValueError naming
    the key."""
    if text is None:
        return None
    kind, _, step = str(text).partition("@")
    needs_step = kind in _WITH_STEP
    if kind not in KINDS or needs_step != step.isdigit() or (step.isdigit() and int(step) < 1):
        raise ValueError(
            f"debug.fault={text!r} is not a known fault: use nan_grad@STEP, perturb_replica@STEP, "
            "raise@STEP, "
            "slow_save@SECONDS or replica_sync_sum"
        )
    return Fault(kind=kind, step=int(step) if step else None)


def _first_plain(model: nn.Module) -> torch.Tensor:
    for _, parameter, _ in unmarked_parameters([model]):
        if not isinstance(parameter, DTensor):
            return parameter
    raise RuntimeError("no plain replicated parameter to inject a fault into")


class _StepCounter:
    """The 1-based step a training forward belongs to, from the count of training forwards so
    far."""

    def __init__(self, model: nn.Module, first_step: int, micro_batches_per_step: int) -> None:
        self.forwards, self.first_step, self.per_step = 0, first_step, micro_batches_per_step
        model.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args) -> None:
        if module.training:
            self.forwards += 1

    @property
    def step(self) -> int:
        """The step of the latest training forward."""
        return self.first_step + (self.forwards - 1) // self.per_step + 1

    @property
    def last_micro_batch(self) -> bool:
        return self.forwards % self.per_step == 0


def install_faults(
    fault: Fault | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    first_step: int,
    micro_batches_per_step: int,
) -> Callable[[Path], None] | None:
    """Install ``fault`` on ``model``/``optimizer``; returns the checkpoint writer's
    ``before_commit`` callback (``slow_save``) or None. Call once, after the model is sharded and
    before its replicas are broadcast."""
    if fault is None:
        return None
    if fault.kind == "slow_save":
        return lambda folder: time.sleep(fault.step)
    if fault.kind == "replica_sync_sum":
        for module in model.modules():
            if tp_replica_reduction(module) != "skip":
                mark_tp_replica_gradient_reduction(module, "sum")
        return None
    counter = _StepCounter(model, first_step, micro_batches_per_step)
    last = rank == world_size - 1
    if fault.kind == "raise" and last:
        _crash_at(fault.step, model, counter)
    elif fault.kind == "nan_grad" and rank == 0:
        _poison_at(fault.step, model, counter)
    elif fault.kind == "perturb_replica" and last:
        _nudge_at(fault.step, model, optimizer, counter)
    return None


def _crash_at(step: int, model: nn.Module, counter: _StepCounter) -> None:
    """Raise in the first training forward of ``step``."""

    def crash(module: nn.Module, args) -> None:
        if module.training and counter.step == step:
            raise RuntimeError(f"injected fault (debug.fault=raise@{step})")

    model.register_forward_pre_hook(crash)


def _poison_at(step: int, model: nn.Module, counter: _StepCounter) -> None:
    """A NaN in the first plain parameter's gradient at the last micro-batch of ``step``."""

    def poison(parameter: torch.Tensor) -> None:
        if counter.step == step and counter.last_micro_batch:
            parameter.grad.view(-1)[0] = float("nan")

    _first_plain(model).register_post_accumulate_grad_hook(poison)


def _nudge_at(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, counter) -> None:
    """Move one replica's first plain parameter after the optimizer step of ``step``."""

    @torch.no_grad()
    def nudge(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if counter.step == step:
            _first_plain(model).view(-1)[0] += 1e-3

    optimizer.register_step_post_hook(nudge)
