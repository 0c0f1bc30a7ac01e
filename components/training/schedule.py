"""Learning-rate schedules chosen by name: shardtune's ``warmup_cosine`` and
``transformers.get_scheduler``'s.

Every schedule is a ``LambdaLR`` (or another ``LRScheduler``) stepped once per optimizer step, so
its state goes into the training checkpoint. Names:

- ``warmup_cosine`` (shardtune's own): linear warmup, then a cosine to ``min_lr_ratio`` ×
  lr at ``max_steps``. Options: ``min_lr_ratio``.
- the names of ``transformers.SchedulerType`` that need no metric: ``linear``, ``cosine``,
  ``cosine_with_restarts``, ``polynomial``, ``constant``, ``constant_with_warmup``,
  ``inverse_sqrt``, ``cosine_with_min_lr``, ``cosine_warmup_with_min_lr``, ``warmup_stable_decay``.
  Their options are the keyword arguments of transformers' schedule function (e.g.
  ``num_decay_steps``, ``min_lr_ratio``, ``decay_type`` for ``warmup_stable_decay``), checked
  against its signature by :func:`check_schedule`.
"""

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
from transformers.trainer_utils import SchedulerType

WARMUP_COSINE = "warmup_cosine"
# Schedules that step on a metric (reduce_lr_on_plateau) or need extra objects (greedy) are left
# out.
TRANSFORMERS_SCHEDULES = tuple(
    kind.value
    for kind in SchedulerType
    if kind not in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY)
)
SCHEDULES = (WARMUP_COSINE, *TRANSFORMERS_SCHEDULES)
# Arguments the caller fills in from its own keys; never options.
_FILLED_IN = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> LambdaLR:
    """Multiply each group's lr by a factor rising linearly over ``warmup_steps``, then falling
    along a cosine to ``min_lr_ratio`` at ``max_steps``. Step it once per optimizer step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def _schedule_function(name: str) -> Callable:
    return (
        warmup_cosine if name == WARMUP_COSINE else TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    )


def schedule_options(name: str) -> dict[str, inspect.Parameter]:
    """The options schedule ``name`` accepts (keyword arguments beyond optimizer, warmup and run
    length)."""
    parameters = inspect.signature(_schedule_function(name)).parameters
    filled = (*_FILLED_IN, "warmup_steps", "max_steps") if name == WARMUP_COSINE else _FILLED_IN
    return {key: parameter for key, parameter in parameters.items() if key not in filled}


def check_schedule(
    name: str, warmup_steps: int, max_steps: int, options: Mapping[str, Any]
) -> list[str]:
    """Error lines (empty when all is well) for a schedule about to be built, for the pre-launch
    checks.

    Checks the name, that warmup is not longer than the run, that every option is one the schedule
    takes and that every option it requires is given.
    """
    if name not in SCHEDULES:
        return [f"schedule={name!r} is not a known schedule; use one of {', '.join(SCHEDULES)}"]
    errors = []
    if warmup_steps > max_steps:
        errors.append(
            f"train.warmup_steps={warmup_steps} is longer than the run "
            f"(train.max_steps={max_steps}); "
            f"use at most {max_steps} warmup steps"
        )
    accepted = schedule_options(name)
    for key in sorted(set(options) - set(accepted)):
        known = ", ".join(sorted(accepted)) or "none"
        errors.append(
            f"schedule.{key} is not an option of schedule {name!r} (its options: {known})"
        )
    required = [
        key for key, parameter in accepted.items() if parameter.default is inspect.Parameter.empty
    ]
    for key in required:
        if key not in options:
            errors.append(f"schedule {name!r} needs schedule.{key}, e.g. +schedule.{key}=...")
    if name == SchedulerType.CONSTANT.value and warmup_steps > 0:
        errors.append(
            f"schedule=constant ignores train.warmup_steps={warmup_steps}; use constant_with_warmup"
        )
    if name == SchedulerType.WARMUP_STABLE_DECAY.value and not errors:
        errors.extend(_phase_errors(warmup_steps, max_steps, options))
    if not errors:
        errors.extend(_trial_errors(name, warmup_steps, max_steps, options))
    return errors


def _phase_errors(warmup_steps: int, max_steps: int, options: Mapping[str, Any]) -> list[str]:
    """Warmup-stable-decay: its phases must fit in the run."""
    phases = [warmup_steps, options["num_decay_steps"], options.get("num_stable_steps") or 0]
    if not all(isinstance(steps, int) for steps in phases) or sum(phases) <= max_steps:
        return []
    return [
        f"schedule=warmup_stable_decay: train.warmup_steps={warmup_steps} + "
        "schedule.num_stable_steps + "
        f"schedule.num_decay_steps={options['num_decay_steps']} = {sum(phases)} steps, longer "
        "than the run "
        f"(train.max_steps={max_steps})"
    ]


def _trial_errors(
    name: str, warmup_steps: int, max_steps: int, options: Mapping[str, Any]
) -> list[str]:
    """Build the schedule on a throwaway optimizer and read its factor where it can go wrong: the
    schedule function's own checks (an option of the wrong type, a warmup-stable-decay longer than
    the run) and a negative or non-finite learning rate become error lines. O(1) in ``max_steps``:
    the factor is read at :func:`_trial_steps`, not walked step by step (a billion steps check at
    once)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        scheduler = _build(
            optimizer, name, warmup_steps, max_steps, options
        )  # every one a LambdaLR
        steps = _trial_steps(warmup_steps, max_steps, options)
        factors = [factor(step) for step in steps for factor in scheduler.lr_lambdas]
    except (TypeError, ValueError, ZeroDivisionError) as error:
        return [f"schedule={name} with {dict(options)}: {error}"]
    if not all(math.isfinite(factor) and factor >= 0 for factor in factors):
        return [
            f"schedule={name} with {dict(options)} gives a negative or non-finite learning rate"
        ]
    return []


_TRIAL_SAMPLES = 256  # evenly spaced steps read besides the phase boundaries


def _trial_steps(warmup_steps: int, max_steps: int, options: Mapping[str, Any]) -> list[int]:
    """The steps 0..max_steps-1 at which a schedule's factor is read: either side of every phase
    boundary (warmup, and warmup plus each integer option and their sum, as warmup-stable-decay's
    phases) and evenly spaced ones between."""
    lengths = [v for v in options.values() if isinstance(v, int) and not isinstance(v, bool)]
    boundaries = {0, warmup_steps, max_steps, warmup_steps + sum(lengths)}
    boundaries |= {warmup_steps + length for length in lengths}
    boundaries |= {max_steps - length for length in lengths}
    near = {step + delta for step in boundaries for delta in (-1, 0, 1)}
    spaced = {max_steps * k // _TRIAL_SAMPLES for k in range(_TRIAL_SAMPLES)}
    return sorted(step for step in near | spaced if 0 <= step < max_steps)


def build_schedule(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup_steps: int,
    max_steps: int,
    options: Mapping[str, Any],
) -> LRScheduler:
    """The LR scheduler ``name`` over ``max_steps`` optimizer steps with ``warmup_steps`` of warmup.

    Raises:
        ValueError: With :func:`check_schedule`'s lines joined, when it finds any.
    """
    errors = check_schedule(name, warmup_steps, max_steps, options)
    if errors:
        raise ValueError("; ".join(errors))
    return _build(optimizer, name, warmup_steps, max_steps, options)


def _build(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup_steps: int,
    max_steps: int,
    options: Mapping[str, Any],
) -> LRScheduler:
    if name == WARMUP_COSINE:
        return warmup_cosine(optimizer, warmup_steps, max_steps, **options)
    function = _schedule_function(name)
    keywords = {"num_warmup_steps": warmup_steps, "num_training_steps": max_steps, **options}
    accepted = inspect.signature(function).parameters
    return function(optimizer, **{key: value for key, value in keywords.items() if key in accepted})
