"""Dropout under tensor parallelism, as Megatron's model-parallel RNG tracker draws it: a region
replicated over TP (the residual stream after a rowwise layer's all-reduce) draws the same mask on
every TP rank, so the copies never drift; a sharded region (a colwise layer's output up to the next
rowwise layer's input: attention over a rank's heads, an MLP's slice; with sequence parallelism,
the whole forward, whose activations are split by heads or by tokens) draws a mask of its own on
each rank, so no two heads or tokens share one.

Every rank seeds torch's generators alike (``join_world``), so the replicated regions agree as they
are. Entering a sharded region draws one number from the CPU generator (the same on every rank:
the shared stream advances alike whatever the shard sizes), seeds the device's generator with it
plus the TP rank, and leaving restores the shared state. Activation checkpointing stashes and
restores the generators around a block, so a recomputed block draws the same masks again.
DTensor's own random ops keep their rule on CUDA (torch's ``OffsetBasedRNGTracker``), within the
state this module sets.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


class ShardedRandomness:
    """The switch between the generator state every TP rank shares and a per-rank one."""

    def __init__(self, device: torch.device, tp_rank: int):
        self.tp_rank = tp_rank
        self.generator = (
            torch.cuda.default_generators[device.index or 0]
            if device.type == "cuda"
            else torch.default_generator
        )
        self.shared_state: torch.Tensor | None = None

    def enter(self, *_) -> None:
        if self.shared_state is None:
            seed = int(torch.randint(2**62, (), generator=torch.default_generator))
            self.shared_state = self.generator.get_state()
            self.generator.manual_seed(seed + self.tp_rank)

    def leave(self, *_) -> None:
        if self.shared_state is not None:
            self.generator.set_state(self.shared_state)
            self.shared_state = None


def _tp_split(module: nn.Module, tp_mesh: DeviceMesh) -> int | None:
    """The dimension of its own ``weight`` a linear layer is split on over ``tp_mesh`` (0: colwise,
    1: rowwise), else None."""
    weight = module._parameters.get("weight")
    if isinstance(module, nn.Embedding) or not isinstance(weight, DTensor) or weight.dim() != 2:
        return None
    if weight.device_mesh.mesh_dim_names != tp_mesh.mesh_dim_names:
        return None  # experts split over the expert-parallel mesh
    shards = [p.dim for p in weight.placements if isinstance(p, Shard)]
    return shards[0] if shards else None


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` drops anything: its Hugging Face config's ``*dropout*`` or ``*pdrop*``
    above 0 (attention dropout is a float, not a module), or a dropout module (LoRA's)."""
    config = getattr(model, "config", None)
    settings = config.to_dict().items() if config is not None else ()
    return any(
        ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0
        for key, value in settings
    ) or any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def shard_dropout_masks(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, device: torch.device
) -> ShardedRandomness:
    """Make ``model``'s sharded regions (see the module docstring) draw per-rank masks; call after
    its TP plan is applied."""
    randomness = ShardedRandomness(device, tp_mesh.get_local_rank())
    model.register_forward_pre_hook(randomness.enter if sequence_parallel else randomness.leave)
    model.register_forward_hook(randomness.leave)
    if not sequence_parallel:
        for module in model.modules():
            split = _tp_split(module, tp_mesh)
            if split == 0:
                module.register_forward_hook(randomness.enter)
            elif split == 1:
                module.register_forward_pre_hook(randomness.leave)
    return randomness
