"""Load balance of MoE experts: the tokens per expert imbalance of each step, and the router's auxiliary loss.

Imbalance: tokens per expert, max / mean, per MoE layer, the worst layer reported.

A forward pre-hook on each experts module counts the expert choices it is called with (``top_k_index``,
the second argument of a transformers 5 experts forward) while gradients are enabled, so validation is
not counted. Only real tokens count: before each micro-batch the caller hands :meth:`ExpertLoad.count_real`
the batch's real-token mask (``Batch.real_mask()``), because the padding after a row's examples is routed too,
and a padded batch would otherwise report the experts its padding token goes to as overloaded. The experts
see every token of the micro-batch in row-major order in both dispatch modes and under sequence parallelism
(the MoE block gathers the sequence), so the mask lines up with the routed rows; a mismatch raises.
Those tokens are the same on every rank of a TP group, so the counts are summed over the dp
group only. Activation checkpointing recomputes each forward once more, which scales every count alike and
leaves max / mean unchanged.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from components.moe.expert_parallel import expert_modules


def router_aux_loss_weight(config, micro_batches: int, dp: int) -> float:
    """The weight of the model's load-balancing loss in each micro-batch's backward: its config's
    ``router_aux_loss_coef`` spread over the step's micro-batches and dp ranks, so the dp sum of gradients is
    the coefficient times the mean auxiliary loss (as Hugging Face adds it to a batch's loss); 0 unless the
    config sets ``output_router_logits``. Under TP the loss is the same on every rank, like the router."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return config.router_aux_loss_coef / (micro_batches * dp)


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since the last :meth:`imbalance`."""

    def __init__(self, model: nn.Module, patterns: list[str], num_experts: int, dp_group: dist.ProcessGroup | None):
        names = expert_modules(model, patterns)
        self.dp_group = dp_group
        self.counts = torch.zeros(len(names), num_experts, dtype=torch.int64)
        self.real: torch.Tensor | None = None  # flat real-token mask of the micro-batch being run; None: all
        self.handles = [
            model.get_submodule(name).register_forward_pre_hook(partial(self._count, row))
            for row, name in enumerate(names)
        ]

    @classmethod
    def watch(cls, model: nn.Module, config, patterns: list[str], dp_group) -> "ExpertLoad | None":
        """Count the expert choices of ``model`` (None for a model without experts)."""
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return cls(model, patterns, num_experts, dp_group) if patterns and num_experts else None

    def count_real(self, mask: torch.Tensor) -> None:
        """Count only the positions where ``mask`` ([rows, seq_len], the next micro-batch's) is True."""
        self.real = mask.reshape(-1)

    def _count(self, row: int, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            choices = args[1]  # [tokens, top_k]
            if self.counts.device != choices.device:  # once: the counts live where the routing runs (no sync)
                self.counts = self.counts.to(choices.device)
            if self.real is None:
                weights = torch.ones_like(choices)
            elif len(choices) != len(self.real):
                raise RuntimeError(
                    f"expert load: {len(choices)} tokens were routed but the real-token mask has "
                    f"{len(self.real)} positions"
                )
            else:  # a 0/1 weight per choice, not a boolean index (which would make a GPU wait for its size)
                weights = self.real.to(choices.dtype).unsqueeze(1).expand_as(choices)
            # index_add_, not bincount: bincount sizes its output from the largest id, a GPU-to-host sync
            self.counts[row].index_add_(0, choices.reshape(-1), weights.reshape(-1))

    def imbalance(self) -> float:
        """The largest max/mean of tokens per expert over the MoE layers in the global batch; resets the counts.
        A collective over the dp group: every rank calls it."""
        counts = self.counts.clone()
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(counts, group=self.dp_group)
        self.counts.zero_()
        counts = counts.cpu().double()
        mean = counts.mean(dim=1).clamp_min(1e-12)
        return (counts.max(dim=1).values / mean).max().item() if len(counts) else 1.0
