"""Measure how far the TP copies of every replicated tensor have drifted apart.

Two all-reduces over the TP group (element-wise MAX and MIN of one flat buffer of every replicated
parameter) give, for each tensor, the largest difference between any two of its copies. On the CPU the
answer must be exactly 0 after every step; anything else means the copies became different models.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.distributed.flat_buffers import local_tensor
from components.distributed.tp_replicas import tp_replicated_parameters, tp_submesh


def _replicated_tensors(model_parts: list[nn.Module], device_mesh: DeviceMesh) -> list[tuple[str, torch.Tensor]]:
    """(name, rank-local storage) of every TP-replicated floating-point parameter, in rank-stable name order."""
    return [
        (name, local_tensor(tensor).detach())
        for name, tensor, _ in tp_replicated_parameters(model_parts, device_mesh)
        if not local_tensor(tensor).is_meta and tensor.is_floating_point() and tensor.numel()
    ]


@torch.no_grad()
def replica_drift(model_parts: list[nn.Module], device_mesh: DeviceMesh | None) -> dict[str, float]:
    """Largest absolute difference between the TP copies of each replicated tensor (empty without TP)."""
    tp_mesh = tp_submesh(device_mesh)
    if tp_mesh is None:
        return {}
    tensors = _replicated_tensors(model_parts, device_mesh)
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


def check_replicas(model_parts: list[nn.Module], device_mesh: DeviceMesh | None, step: int) -> None:
    """Stop (on every rank: the drift is the same everywhere) if any TP-replicated parameter differs across ranks."""
    drifted = sorted(name for name, spread in replica_drift(model_parts, device_mesh).items() if spread > 0)
    if drifted:
        raise RuntimeError(f"step {step}: TP replicas differ across ranks: {', '.join(drifted)}")


def write_drift_report(model_parts: list[nn.Module], device_mesh: DeviceMesh | None, path: Path, rank: int) -> None:
    """Write the end-of-run drift (``{"max", "tensors"}``) to ``path`` from ``rank`` 0 and say it; raise on every
    rank if any copy differs, so a run whose replicas became different models is not exported."""
    drift = replica_drift(model_parts, device_mesh)
    if rank == 0 and drift:
        worst = max(drift.values())
        path.write_text(json.dumps({"max": worst, "tensors": drift}, indent=1))
        print(f"replica drift: largest difference between TP copies {worst} over {len(drift)} tensors")
    if any(spread > 0 for spread in drift.values()):
        raise RuntimeError(f"TP replicas differ at the end of the run (see {path}): not exported")
