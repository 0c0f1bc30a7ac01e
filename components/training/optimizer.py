"""The optimizer's own checks of its options, run once before any rank starts.

``torch.optim`` validates its hyperparameters when it is built (``betas`` within [0, 1), a
non-negative ``weight_decay``, ...): built on a throwaway parameter here, a bad value is one
``error:`` line in the checks instead of a traceback on every rank after the folder was claimed.
"""

from collections.abc import Mapping
from typing import Any

import torch

from components.targets import check_target, target_class


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
