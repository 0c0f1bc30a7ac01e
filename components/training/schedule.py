"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> LambdaLR:
    """Multiply each group's lr by a factor rising linearly over ``warmup_steps``, then falling along a
    cosine to ``min_lr_ratio`` at ``max_steps``. Step it once per optimizer step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
