"""HSDP's mesh on a fake world of 8 (meta device, nothing allocated): FSDP2 puts every weight on the
2-D ``("dp_replicate", "dp_shard")`` mesh, replicated across dim 0 and sharded along dim 1, while
the loader's and the loss's ``dp`` is the flattened pair; experts and TP stay on their own views."""

import torch
from torch.distributed.tensor import Replicate, Shard

from components.distributed.layout import resolve_parallel_dims
from components.models.parallelize import build_parallel_model
from recipes.tiny_models import tiny_config
from tests.harness import spec_for


def test_fsdp_replicates_across_and_shards_within(fake_world):
    dims = resolve_parallel_dims(8, tp=2, dp_replicate=2)
    meshes = dims.build_meshes("cpu")
    assert meshes.world.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert (meshes.batch.size(), meshes.loss.size()) == (4, 4)
    assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert meshes.batch.get_local_rank() == 2  # rank 5: replica 1, shard 0 → 1 × 2 + 0
    spec = spec_for(tiny_config("llama"))
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("meta"))
    norm = model.model.norm.weight  # TP-replicated: FSDP's 2-D mesh plus tp
    assert norm.device_mesh.mesh_dim_names[:2] == ("dp_replicate", "dp_shard")
    assert norm.placements[:2] == (Replicate(), Shard(0))
    for parameter in model.parameters():
        assert parameter.device_mesh.mesh_dim_names[:2] == ("dp_replicate", "dp_shard")
