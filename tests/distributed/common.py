"""Helpers shared by the distributed tests: a one-parameter module and a collective recorder."""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


class Holder(nn.Module):
    """A module with one direct parameter, like a norm: the unit the markers apply to."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool = True):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)


@contextmanager
def recorded_collectives():
    """Record (name, dtype, numel) of every all_reduce/broadcast the module issues through
    ``dist``."""
    calls: list[tuple[str, torch.dtype, int]] = []
    original = {"all_reduce": dist.all_reduce, "broadcast": dist.broadcast}

    def recording(name):
        def call(tensor, *args, **kwargs):
            calls.append((name, tensor.dtype, tensor.numel()))
            return original[name](tensor, *args, **kwargs)

        return call

    for name in original:
        setattr(dist, name, recording(name))
    try:
        yield calls
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
