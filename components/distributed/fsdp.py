"""Data parallelism composed with TP: FSDP2 ``fully_shard`` over the ``dp`` axis, on every backend.

Replicated parameters (norms) become DTensors on the ``dp`` submesh; ``tp_replicas`` recognises them
as TP replicas from their mesh coordinates. Expert parameters (DTensors on the MoE mesh,
``components.moe``) are left out of FSDP: expert parallelism already splits them over ``ep`` and
``finalize_dtensor_gradients`` sums their gradients over ``ep_shard``.

Gradients are *summed* over dp ranks (divide factor 1): the recipe normalises the loss by the token
count of the whole global batch, so the sum is the true gradient. The sum is forced in every
precision: gloo has no PREMUL_SUM. Mixed precision: ``PrecisionPolicy.fsdp_policy()``.
``train.cpu_offload``: FSDP2's ``CPUOffloadPolicy`` on every wrapped module (sharded parameters,
gradients, so the optimizer's state and step, in host memory; FSDP at dp=1 too, a one-rank shard).

Design notes: docs/design-notes.md
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor


def shard_data_parallel(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Wrap each decoder layer, then the whole model, with ``fully_shard`` on ``fsdp_mesh``
    (the run's ``Meshes.fsdp``: dp × cp; with HSDP, (dp_replicate, dp_shard) in 2-D).

    ``mp_policy`` (None: FSDP2's default, compute and reduction in the parameters' dtype) is applied
    to every wrapped module; ``cpu_offload``: FSDP2's ``CPUOffloadPolicy`` too (host memory pinned
    where the mesh is on CUDA). Call after the TP plan, activation checkpointing and compile.
    """
    policy = mp_policy or MixedPrecisionPolicy()
    offload_policy = (
        CPUOffloadPolicy(pin_memory=fsdp_mesh.device_type == "cuda")
        if cpu_offload
        else OffloadPolicy()
    )
    experts = set(expert_parameters(model))
    layers = getattr(getattr(model, "model", None), "layers", None)
    for module in [*(layers if layers is not None else []), model]:  # each layer, then the root
        fully_shard(
            module,
            mesh=fsdp_mesh,
            mp_policy=policy,
            offload_policy=offload_policy,
            ignored_params=experts,
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters split by expert parallelism: DTensors on a mesh with an ``ep`` dimension."""
    return [
        p
        for p in model.parameters()
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    ]


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the dp reduce-scatter on the next backward: for gradient
    accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def reshard(model: nn.Module) -> None:
    """Put every FSDP module of ``model`` back to its sharded parameters: the root keeps its
    parameters gathered after a forward without backward (a validation), and a write into those
    (merging adapters) would never reach the shards that checkpoints and exports read."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
