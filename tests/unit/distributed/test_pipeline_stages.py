"""Pipeline stages: the cut at decoder layers (the embedding and the head weighed as one layer
each), and a stage built on a fake world of 8 (meta device): the mesh's ``pp`` dimension outermost,
the stage's parameters named as in the whole model, TP and FSDP applied to it alone."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from components.distributed.layout import resolve_parallel_dims
from components.distributed.pipeline import stage_layers
from components.models.parallelize import build_parallel_model
from recipes.tiny_models import tiny_config
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
    assert dims.mesh_layout() == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    with pytest.raises(ValueError, match="world size 6 is not divisible by pp=4 × tp=1"):
        resolve_parallel_dims(6, pp=4)


def test_a_stage_keeps_its_layers_names_and_parallelism(fake_world):
    dims = resolve_parallel_dims(8, tp=2, pp=2)
    meshes = dims.build_meshes("cpu")
    mesh = meshes.world
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert mesh["pp"].get_local_rank() == 1  # rank 5: the last of 2 stages
    spec = spec_for(tiny_config("llama", num_hidden_layers=4))
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("meta"))
    names = [name for name, _ in model.named_parameters()]
    layers = sorted({name.split(".")[2] for name in names if name.startswith("model.layers.")})
    assert layers == ["2", "3"], layers  # the last 2 of 4 layers, under their own indices
    assert {"model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= set(
        names
    )
    assert model.model.embed_tokens is None
    head = model.lm_head.weight
    assert isinstance(head, DTensor) and head.device_mesh.mesh_dim_names == ("dp", "tp")


def test_a_stage_decoder_reads_its_own_layers_per_layer_settings():
    """A decoder's forward reads per-layer settings by the layer's position in its list
    (``config.layer_types[i]``): a stage's config holds its layers' entries, in order; the layers
    and the model keep the whole config."""
    from components.distributed.pipeline import stage_config
    from components.models import meta_causal_lm
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("gemma3_text")
    config.num_hidden_layers = 3
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    config.eos_token_id = [1, 2, 3]
    staged = stage_config(config, [2])
    assert staged.layer_types == ["full_attention"]
    assert staged.eos_token_id == [1, 2, 3] and staged.hidden_size == config.hidden_size
    assert config.layer_types[2] == "full_attention" and len(config.layer_types) == 3
    model = meta_causal_lm(coverage_config("gemma3_text"))
    from components.distributed.pipeline import keep_stage

    keep_stage(model, [1], first=False, last=True)
    assert model.model.config.layer_types == [model.config.layer_types[1]]
    assert model.model.layers[0].self_attn.config is model.config
