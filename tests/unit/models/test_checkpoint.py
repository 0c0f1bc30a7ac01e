"""Checkpoint reads any box of a stored tensor, and of fused experts assembled from per-expert tensors."""

import pytest
import torch

from components.models import build_causal_lm, tiny_config
from components.models.checkpoint import Checkpoint, StackedExperts, StoredTensor, find_source


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    model = build_causal_lm(tiny_config("qwen3_moe"), seed=5)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(folder, max_shard_size="100KB")
    return model, folder


def test_a_box_of_a_stored_tensor(qwen3_moe):
    model, folder = qwen3_moe
    with Checkpoint(folder) as checkpoint:
        source = find_source(checkpoint, "model.layers.1.self_attn.k_proj.weight", (32, 64), "qwen3_moe", {})
        assert source == StoredTensor("model.layers.1.self_attn.k_proj.weight")
        box = source.read(checkpoint, (8, 16), (16, 32))
    assert torch.equal(box, model.model.layers[1].self_attn.k_proj.weight[8:24, 16:48])


@pytest.mark.parametrize(
    ("offset", "size"),
    [
        ((0, 0, 0), (8, 128, 64)),  # everything
        ((2, 48, 8), (3, 32, 40)),  # rows across the gate/up boundary at 64
        ((7, 64, 0), (1, 64, 64)),  # only up rows of the last expert
        ((4, 0, 0), (4, 64, 32)),  # only gate rows
    ],
)
def test_a_box_of_fused_experts_from_per_expert_tensors(qwen3_moe, offset, size):
    model, folder = qwen3_moe
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    with Checkpoint(folder) as checkpoint:
        source = find_source(checkpoint, "model.layers.0.mlp.experts.gate_up_proj", tuple(fused.shape), "qwen3_moe", {})
        assert isinstance(source, StackedExperts) and source.shape(checkpoint) == (8, 128, 64)
        box = source.read(checkpoint, offset, size)
    expected = fused[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
    assert torch.equal(box, expected)


def test_tied_partner_is_read_when_a_name_is_absent(qwen3_moe):
    _, folder = qwen3_moe
    with Checkpoint(folder) as checkpoint:
        tied = {"model.extra.weight": "lm_head.weight"}
        assert find_source(checkpoint, "model.extra.weight", (256, 64), None, tied) == StoredTensor("lm_head.weight")
        with pytest.raises(KeyError, match=r"model\.extra\.weight is not in the checkpoint .*looked for model\.extra"):
            find_source(checkpoint, "model.extra.weight", (256, 64), None, {})
