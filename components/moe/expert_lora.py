"""Per-expert LoRA on fused 3-D expert weights: what an adapted experts module holds, and the
low-rank term its forward adds (docs/lora.md).

Beside each expert weight W (``gate_up_proj`` [E, out, in], ``down_proj``) an adapted experts
module holds ``lora_A.<weight>`` [E, r, in] and ``lora_B.<weight>`` [E, out, r] and a
``lora_scaling``: expert e applies W_e + scaling · B_e·A_e, as PEFT's ``ParamWrapper``
(``LoraConfig(target_parameters=...)``) does, but computed on the activations,
x·W_eᵀ + scaling · (x·A_eᵀ)·B_eᵀ: no E × out × in update is formed and the frozen W gets no
gradient. Expert parallelism splits the adapters by expert, as it splits W.
"""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

ADAPTERS = ("lora_A", "lora_B")
ADAPTED_WEIGHTS = ("gate_up_proj", "down_proj")  # in the experts module's registration order


@dataclasses.dataclass(frozen=True, kw_only=True)
class LowRank:
    """One forward's adapters of an experts module (local experts, compute dtype): (A, B) of
    ``gate_up_proj`` and of ``down_proj``, and the scaling."""

    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    scaling: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.gate_up, *self.down)

    def at(self, expert: int) -> "LowRank":
        """The adapters of one local expert (2-D A and B)."""
        return self._map(lambda tensor: tensor[expert])

    def to(self, dtype: torch.dtype) -> "LowRank":
        return self._map(lambda tensor: tensor.to(dtype))

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> "LowRank":
        pick = [(change(A), change(B)) for A, B in (self.gate_up, self.down)]
        return LowRank(gate_up=pick[0], down=pick[1], scaling=self.scaling)


def has_expert_adapters(experts: nn.Module) -> bool:
    """Whether ``experts`` carries per-expert adapters (``lora_A`` and ``lora_B``)."""
    return all(isinstance(getattr(experts, name, None), nn.ParameterDict) for name in ADAPTERS)


def expert_low_rank(
    experts: nn.Module, local: Callable[[torch.Tensor], torch.Tensor]
) -> LowRank | None:
    """The adapters of ``experts`` as ``local`` makes each tensor usable in a forward (this rank's
    experts, the compute dtype), or None when it has none."""
    if not has_expert_adapters(experts):
        return None
    pairs = [
        (local(experts.lora_A[weight]), local(experts.lora_B[weight])) for weight in ADAPTED_WEIGHTS
    ]
    return LowRank(gate_up=pairs[0], down=pairs[1], scaling=experts.lora_scaling)


def adapted(
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    weight: torch.Tensor,
    low_rank: LowRank | None,
    which: str,
) -> torch.Tensor:
    """``linear(rows, weight)``, plus ``scaling · linear(linear(rows, A), B)`` with the adapter
    ``which`` (``gate_up`` or ``down``) of ``low_rank`` when there is one."""
    output = linear(rows, weight)
    if low_rank is None:
        return output
    A, B = getattr(low_rank, which)
    return output + linear(linear(rows, A), B) * low_rank.scaling
