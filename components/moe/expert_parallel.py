"""Expert parallelism for Hugging Face MoE blocks (transformers 5 fused experts), folded onto TP ranks.

A transformers 5 MoE block (Qwen3-MoE, Mixtral, and others with the same layout) holds its experts as two
fused 3-D parameters, ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I], and its
router as ``gate.weight`` [E, H]. Here each rank of an ``ep`` group keeps E/ep whole experts: the expert
parameters become DTensors on the MoE mesh ``("ep_shard", "ep")`` with ``Shard(0)`` on ``ep`` (and
``Replicate`` on ``ep_shard``), so checkpoints reshard, the grad norm counts each expert once, and
``tp_replicas`` sees they are not copies. The subtree is also marked with
``exclude_from_tp_replica_sync``, the explicit statement that its local tensors are different experts.

Token routing: the ``ep`` ranks are adjacent and ``ep`` divides ``tp``, so an EP group lies inside one
TP group, where the MoE block's input tokens are already replicated. Each rank therefore runs its own
experts on the tokens routed to them and one all-reduce over the EP group sums the partial outputs; no
all-to-all is needed (an all-to-all would move the same tokens to ranks that already hold them). The
backward of that sum is the identity: every rank receives the same output gradient. The router sees
replicated tokens and computes redundantly, so its gradient keeps the default ``mean`` reduction.
"""

import fnmatch
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from components.distributed.tp_replicas import exclude_from_tp_replica_sync

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce SUM of per-rank partial outputs. Backward: identity (the output gradient is
    the same on every rank, and each rank's partial output needs exactly that gradient)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _EnterExpertGroup(torch.autograd.Function):
    """Forward: identity on the replicated tokens and routing weights. Backward: one all-reduce SUM of
    both gradients, because each rank's experts contribute only their part (Megatron's "f" to
    ``_SumOverGroup``'s "g"). One node for both keeps a single collective per block in backward."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        return hidden_states.view_as(hidden_states), weights.view_as(weights)

    @staticmethod
    def backward(ctx, hidden_grad: torch.Tensor, weights_grad: torch.Tensor):
        # Summed in FP32 whatever the activations' dtype (bf16 models keep fp32 routing weights).
        flat = torch.cat([hidden_grad.reshape(-1).float(), weights_grad.reshape(-1).float()])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
        hidden, weights = flat.split([hidden_grad.numel(), weights_grad.numel()])
        return (
            hidden.view_as(hidden_grad).to(hidden_grad.dtype),
            weights.view_as(weights_grad).to(weights_grad.dtype),
            None,
        )


def _local_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' forward on this rank's experts only, then the sum over the EP group."""
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    hidden_states, top_k_weights = _EnterExpertGroup.apply(hidden_states, top_k_weights, self._ep_group)
    first = self._ep_first_expert
    # Tie the inputs and this rank's expert weights into the output even when no token reaches its
    # experts: every rank then runs the backward collective (a rank that skipped it would leave its peers
    # waiting) and every expert gets a gradient, zero when unused, as in the single-process model.
    tie = hidden_states.sum() + top_k_weights.sum() + gate_up.sum() + down.sum()
    output = torch.zeros_like(hidden_states) + 0.0 * tie
    for local in range(gate_up.shape[0]):
        token_index, slot = torch.where(top_k_index == first + local)
        if token_index.numel() == 0:
            continue
        gate, up = F.linear(hidden_states[token_index], gate_up[local]).chunk(2, dim=-1)
        expert_out = F.linear(self.act_fn(gate) * up, down[local]) * top_k_weights[token_index, slot, None]
        output = output.index_add(0, token_index, expert_out.to(output.dtype))
    return _SumOverGroup.apply(output, self._ep_group)


def _expert_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    names = [name for name, _ in model.named_modules() if name]
    return sorted({name for pattern in patterns for name in fnmatch.filter(names, pattern)})


def check_expert_parallel(model: nn.Module, patterns: list[str], num_experts: int, ep: int, tp: int) -> list[str]:
    """Every reason expert parallelism cannot run (empty when it can)."""
    errors = []
    if ep > 1 and not patterns:
        errors.append(f"ep={ep} needs an MoE model: model.experts names no expert modules")
        return errors
    modules = _expert_modules(model, patterns)
    for pattern in patterns:
        if not fnmatch.filter(modules, pattern):
            errors.append(f"model.experts pattern {pattern!r} matches no module of {type(model).__name__}")
    for name in modules:
        missing = [p for p in EXPERT_PARAMETERS if not hasattr(model.get_submodule(name), p)]
        if missing:
            errors.append(f"{name} has no fused expert parameters {missing}: not a transformers 5 experts module")
    if num_experts % ep:
        errors.append(f"ep ({ep}) must divide the number of experts ({num_experts})")
    if tp % ep:
        errors.append(f"ep ({ep}) must divide tp ({tp}): experts are split across ranks that share the same tokens")
    return errors


def apply_expert_parallel(model: nn.Module, moe_mesh: DeviceMesh, patterns: list[str]) -> list[str]:
    """Split every experts module matched by ``patterns`` by expert over ``moe_mesh["ep"]``; return names.

    Works on a model with real weights (each rank keeps its slice) or on the meta device (load afterwards
    with ``materialize_from_pretrained``). With ``ep == 1`` nothing changes: every rank holds every expert,
    computes it on the same tokens, and the experts are ordinary TP replicas (mean).
    """
    ep_mesh = moe_mesh["ep"]
    if ep_mesh.size() == 1:
        return []
    names = _expert_modules(model, patterns)
    for name in names:
        experts = model.get_submodule(name)
        exclude_from_tp_replica_sync(experts)
        for parameter_name in EXPERT_PARAMETERS:
            full = getattr(experts, parameter_name)
            sharded = distribute_tensor(full.data, moe_mesh, [Replicate(), Shard(0)])
            experts.register_parameter(parameter_name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        experts._ep_first_expert = ep_mesh.get_local_rank() * experts.gate_up_proj.to_local().shape[0]
        experts._ep_group = ep_mesh.get_group()
        experts.forward = types.MethodType(_local_experts_forward, experts)
    return names
