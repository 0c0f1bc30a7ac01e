"""Measure how far the TP copies of every replicated tensor have drifted apart.

Two all-reduces over the TP group (element-wise MAX and MIN of one flat buffer of every replicated
parameter) give, for each tensor, the largest difference between any two of its copies. On the CPU the
answer must be exactly 0 after every step; anything else means the copies became different models.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.distributed.tp_replicas import _get_tp_mesh, _is_tp_replicated, _local_tensor, _unmarked_entries_by_name


def _replicated_tensors(model_parts: list[nn.Module], tp_mesh: DeviceMesh) -> list[tuple[str, torch.Tensor]]:
    """(name, rank-local storage) of every TP-replicated parameter, in rank-stable name order."""
    ranks = tuple(dist.get_process_group_ranks(tp_mesh.get_group()))
    rank = dist.get_rank()
    return [
        (name, _local_tensor(tensor).detach())
        for (_, name), tensor, _ in _unmarked_entries_by_name(model_parts)
        if _is_tp_replicated(tensor, ranks, rank, "tp")
        and not _local_tensor(tensor).is_meta
        and tensor.is_floating_point()
        and tensor.numel()
    ]


@torch.no_grad()
def replica_drift(model_parts: list[nn.Module], device_mesh: DeviceMesh | None) -> dict[str, float]:
    """Largest absolute difference between the TP copies of each replicated tensor (empty without TP)."""
    tp_mesh = _get_tp_mesh(device_mesh, "tp")
    if tp_mesh is None:
        return {}
    tensors = _replicated_tensors(model_parts, tp_mesh)
    if not tensors:
        return {}
    flat = torch.cat([t.reshape(-1).to(torch.float64) for _, t in tensors]).to(tp_mesh.device_type)
    high, low = flat.clone(), flat.clone()
    group = tp_mesh.get_group()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    spread = (high - low).cpu()
    drift, offset = {}, 0
    for name, tensor in tensors:
        drift[name] = spread[offset : offset + tensor.numel()].max().item()
        offset += tensor.numel()
    return drift
