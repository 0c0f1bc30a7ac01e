"""Data parallelism composed with TP: FSDP2 ``fully_shard`` over the ``dp`` axis.

FSDP2 runs on gloo here (measured with torch 2.13 on the CPU: a (dp=2, tp=2) mesh with TP-sharded and
replicated parameters trains and reduces correctly), so it is used on every backend; DDP is not needed.
Replicated parameters (norms) become DTensors on the ``dp`` submesh; ``tp_replicas`` recognises them as
TP replicas from their mesh coordinates.

Gradients are *summed* over dp ranks (divide factor 1): the recipe normalises the loss by the token
count of the whole global batch, so the sum is the true gradient whatever the split.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def shard_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Wrap each decoder layer, then the whole model, with ``fully_shard`` on ``dp_mesh``."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or do (True) the dp reduce-scatter on the next backward: for gradient accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
