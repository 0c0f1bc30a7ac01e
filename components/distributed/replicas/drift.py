"""Measure how far the copies of every replicated tensor have drifted apart.

Copies are the TP replicas (norms, routers, q/k norms: one per TP rank) and the expert copies of
expert parallelism (an expert held once per ``ep_shard`` group, each copy trained on other tokens
and kept equal by summing their gradients). Two all-reduces per group (element-wise MAX and MIN of
one flat buffer of its tensors) give, for each tensor, the largest difference between any two of its
copies. On the CPU the answer must be exactly 0 after every step; anything else means the copies
became different models.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from components.distributed.replicas.flat_buffers import local_tensor
from components.distributed.replicas.plan import tp_replicated_parameters
from components.distributed.replicas.selection import get_tp_mesh


def _replicated_tensors(
    model_parts: list[nn.Module], device_mesh: DeviceMesh
) -> list[tuple[str, torch.Tensor]]:
    """(name, rank-local storage) of every TP-replicated floating-point parameter, in rank-stable
    name order."""
    return [
        (name, local_tensor(tensor).detach())
        for name, tensor, _ in tp_replicated_parameters(model_parts, device_mesh)
        if not local_tensor(tensor).is_meta and tensor.is_floating_point() and tensor.numel()
    ]


def _expert_copies(
    model_parts: list[nn.Module],
) -> dict[DeviceMesh, list[tuple[str, torch.Tensor]]]:
    """Per MoE mesh, (name, local storage) of every parameter replicated over its ``ep_shard``
    dimension."""
    copies: dict[DeviceMesh, list[tuple[str, torch.Tensor]]] = {}
    for part in model_parts:
        for name, parameter in sorted(part.named_parameters(), key=lambda item: item[0]):
            if not isinstance(parameter, DTensor) or "ep_shard" not in (
                parameter.device_mesh.mesh_dim_names or ()
            ):
                continue
            mesh = parameter.device_mesh
            dim = mesh.mesh_dim_names.index("ep_shard")
            if mesh.size(dim) > 1 and isinstance(parameter.placements[dim], Replicate):
                copies.setdefault(mesh, []).append((name, parameter.to_local().detach()))
    return copies


def _spread(
    tensors: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, device_type: str
) -> dict[str, float]:
    if not tensors:
        return {}
    flat = torch.cat([t.reshape(-1).to(torch.float64) for _, t in tensors]).to(device_type)
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    spread = (high - low).cpu()
    drift, offset = {}, 0
    for name, tensor in tensors:
        drift[name] = spread[offset : offset + tensor.numel()].max().item()
        offset += tensor.numel()
    return drift


@torch.no_grad()
def replica_drift(model_parts: list[nn.Module], device_mesh: DeviceMesh | None) -> dict[str, float]:
    """Largest absolute difference between the copies of each replicated tensor: TP replicas, then
    expert copies over ``ep_shard`` (empty when nothing is replicated)."""
    drift = {}
    tp_mesh = get_tp_mesh(device_mesh, "tp")
    if tp_mesh is not None:
        tensors = _replicated_tensors(model_parts, device_mesh)
        drift |= _spread(tensors, tp_mesh.get_group(), tp_mesh.device_type)
    for mesh, tensors in _expert_copies(model_parts).items():
        drift |= _spread(tensors, mesh.get_group("ep_shard"), mesh.device_type)
    return drift


def check_replicas(model_parts: list[nn.Module], device_mesh: DeviceMesh | None, step: int) -> None:
    """Stop (on every rank: the drift is the same everywhere) if any TP-replicated parameter differs
    across ranks."""
    drifted = sorted(
        name for name, spread in replica_drift(model_parts, device_mesh).items() if spread > 0
    )
    if drifted:
        raise RuntimeError(
            f"step {step}: replicated tensors differ across ranks: {', '.join(drifted)}"
        )


def write_drift_report(
    model_parts: list[nn.Module], device_mesh: DeviceMesh | None, path: Path, rank: int
) -> None:
    """Write the end-of-run drift (``{"max", "tensors"}``) to ``path`` from ``rank`` 0 and say it;
    raise on every rank if any copy differs, so a run whose replicas became different models is not
    exported."""
    drift = replica_drift(model_parts, device_mesh)
    if rank == 0 and drift:
        worst = max(drift.values())
        path.write_text(json.dumps({"max": worst, "tensors": drift}, indent=1))
        print(f"replica drift: largest difference between copies {worst} over {len(drift)} tensors")
    if any(spread > 0 for spread in drift.values()):
        raise RuntimeError(
            f"replicated tensors differ at the end of the run (see {path}): not exported"
        )
