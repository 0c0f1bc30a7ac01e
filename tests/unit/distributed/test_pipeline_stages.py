"""Pipeline stages: the cut at decoder layers (the embedding and the head weighed as one layer
each), and a stage built on a fake world of 8 (meta device): the mesh's ``pp`` dimension outermost,
the stage's parameters named as in the whole model, TP and FSDP applied to it alone."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from components.distributed.mesh import build_device_mesh, mesh_layout, resolve_parallel_dims
from components.distributed.pipeline import stage_layers
from components.models import tiny_config
from components.models.parallelize import build_parallel_model
from tests.harness import spec_for


def test_stages_share_the_layers_with_the_embedding_and_head_weighed():
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert stage_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert stage_layers(4, 4) == [range(0, 1), range(1, 3), range(3, 4), range(4, 4)]
    assert stage_layers(1, 3) == [range(0, 0), range(0, 1), range(1, 1)]
    with pytest.raises(ValueError, match="4 pipeline stages need at least 2 decoder layers"):
        stage_layers(1, 4)


def test_the_mesh_layout_is_data():
    dims = resolve_parallel_dims(16, tp=2, pp=2, dp_replicate=2)
    assert mesh_layout(dims) == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    with pytest.raises(ValueError, match="world size 6 is not divisible by pp=4 × tp=1"):
        resolve_parallel_dims(6, pp=4)


def test_a_stage_keeps_its_layers_names_and_parallelism(fake_world):
    dims = resolve_parallel_dims(8, tp=2, pp=2)
    mesh = build_device_mesh(dims, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert mesh["pp"].get_local_rank() == 1  # rank 5: the last of 2 stages
    spec = spec_for(tiny_config("llama", num_hidden_layers=4))
    model, _ = build_parallel_model(spec, dims, mesh, torch.device("meta"))
    names = [name for name, _ in model.named_parameters()]
    layers = sorted({name.split(".")[2] for name in names if name.startswith("model.layers.")})
    assert layers == ["2", "3"], layers  # the last 2 of 4 layers, under their own indices
    assert {"model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= set(
        names
    )
    assert model.model.embed_tokens is None
    head = model.lm_head.weight
    assert isinstance(head, DTensor) and head.device_mesh.mesh_dim_names == ("dp", "tp")
