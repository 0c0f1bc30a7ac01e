"""What a checkpoint saves and a resume restores: one named set of a run's stateful objects."""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from components.moe.load_balance import RoutingBias


class StreamState(Protocol):
    """A loader that keeps its own position (a stream's, ``components/data/streaming.py``):
    ``state_dict`` is collective (every rank calls it at a save) and JSON-able."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class TrainState:
    """A run's state between two steps, by name: the ``model`` (its parameters and persistent
    buffers), the ``optimizer``, the learning-rate ``schedule`` and ``step``, the run's counter
    (the steps done). Each rank's RNG states travel with it in every checkpoint
    (``components/checkpoint/dcp.py``). The data position and the routing bias are named below:
    each is held by one of the objects above, so it is saved and restored exactly once."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRScheduler | None
    step: int = 0
    stream: StreamState | None = None  # a streamed loader, whose position the step does not say

    @property
    def data_position(self) -> int:
        """The next step's batches: the loaders index batches by step
        (``components/data/loader.py``), so the position is the step counter; a streamed loader's
        is its own (``stream``), saved in the checkpoint beside the step."""
        return self.step

    @property
    def routing_bias(self) -> dict[str, torch.Tensor]:
        """An MoE model's per-expert routing bias, by buffer name (empty without one): persistent
        buffers of its routers (``components/moe/load_balance.py``), saved with the model."""
        return {
            name: buffer
            for name, buffer in self.model.named_buffers()
            if name.rpartition(".")[2] == RoutingBias.BUFFER
        }
