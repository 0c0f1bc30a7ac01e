"""A frozen second model on the run's meshes: DPO's reference, distillation's teacher.

It is built, split and loaded exactly as the trained model is (``build_parallel_model``: the TP
plan of its family, expert parallelism, FSDP, context parallelism), its TP replicas made
identical, then frozen: no parameter wants a gradient (so no optimizer ever holds state for it)
and it runs in eval mode (no dropout). Only its forward runs, so it needs no activation
checkpointing.

Docs: docs/dpo.md
"""

from dataclasses import replace

import torch
from torch import nn

from components.distributed.layout import Meshes, ParallelDims
from components.distributed.tp_replicas import broadcast_tp_replicas
from components.models.parallelize import ModelSpec, build_parallel_model


def build_frozen_model(
    spec: ModelSpec, dims: ParallelDims, meshes: Meshes, device: torch.device
) -> nn.Module:
    """The model ``spec`` describes (its config, weights and split), sharded over ``meshes`` as
    ``dims`` says, loaded, and frozen (``requires_grad_(False)``, eval mode). On the meta
    ``device`` (a dry run) nothing gets storage."""
    forward_only = replace(spec, activation_checkpointing="none")
    model, _ = build_parallel_model(forward_only, dims, meshes, device)
    if device.type != "meta":
        broadcast_tp_replicas([model], meshes.world)
    model.requires_grad_(False)
    return model.eval()
