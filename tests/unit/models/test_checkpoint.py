"""Checkpoint reads any box of a stored tensor, and of fused experts assembled from per-expert
tensors."""

import pytest
import torch

from components.models import build_causal_lm
from components.models.checkpoint import (
    Checkpoint,
    Chunked,
    Concatenated,
    Interleaved,
    StackedExperts,
    StoredLayout,
    StoredTensor,
)
from recipes.tiny_models import tiny_config


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    model = build_causal_lm(tiny_config("qwen3_moe"), seed=5)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(folder, max_shard_size="100KB")
    return model, folder


def test_a_box_of_a_stored_tensor(qwen3_moe):
    model, folder = qwen3_moe
    with Checkpoint(folder) as checkpoint:
        source = StoredLayout(checkpoint, model).source(
            "model.layers.1.self_attn.k_proj.weight", {}
        )
        assert source == StoredTensor(key="model.layers.1.self_attn.k_proj.weight")
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
        source = StoredLayout(checkpoint, model).source(
            "model.layers.0.mlp.experts.gate_up_proj", {}
        )
        assert isinstance(source, StackedExperts) and source.shape(checkpoint) == (8, 128, 64)
        box = source.read(checkpoint, offset, size)
    expected = fused[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
    assert torch.equal(box, expected)


def test_tied_partner_is_read_when_a_name_is_absent(qwen3_moe):
    model, folder = qwen3_moe
    with Checkpoint(folder) as checkpoint:
        layout = StoredLayout(checkpoint, model)
        found = layout.source("model.extra.weight", {"model.extra.weight": "lm_head.weight"})
        assert found == StoredTensor(key="lm_head.weight")
        with pytest.raises(
            KeyError,
            match=r"model\.extra\.weight is not in the checkpoint .*looked for model\.extra",
        ):
            layout.source("model.extra.weight", {})


def test_boxes_are_read_without_a_mapping_exactly_as_safetensors_slices_them(tmp_path, monkeypatch):
    """pread reads every box as safetensors' own get_slice does: whole rows in place, column boxes
    through a scratch of whole rows (made 1 KiB here, so they take several chunks), any dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import components.models.checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "SCRATCH_BYTES", 1024)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "scalar": torch.tensor(3.5),
        "vector": torch.randn(40, generator=generator).to(torch.bfloat16),
        "matrix": torch.randn(37, 24, generator=generator),
        "experts": torch.randint(-100, 100, (4, 9, 10), generator=generator, dtype=torch.int32),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    boxes = {
        "scalar": [((), ())],
        "vector": [((0,), (40,)), ((7,), (20,)), ((40,), (0,))],
        "matrix": [((0, 0), (37, 24)), ((5, 0), (19, 24)), ((0, 12), (37, 12)), ((3, 5), (30, 7))],
        "experts": [((2, 0, 0), (2, 9, 10)), ((0, 3, 0), (4, 3, 10)), ((1, 0, 5), (3, 9, 5))],
    }
    path = tmp_path / "model.safetensors"
    with Checkpoint(tmp_path) as checkpoint, safe_open(path, "pt") as stored:
        for key, key_boxes in boxes.items():
            assert checkpoint.shape(key) == tuple(tensors[key].shape)
            for offset, size in key_boxes:
                box = tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))
                expected = stored.get_slice(key)[box] if box else stored.get_tensor(key)
                assert torch.equal(checkpoint.read(key, offset, size), expected), (key, offset)
                assert checkpoint.read(key, offset, size).dtype == tensors[key].dtype
        out = torch.empty(19, 24)
        assert StoredTensor(key="matrix").read_into(checkpoint, (5, 0), out)
        assert torch.equal(out, tensors["matrix"][5:24])
        assert not StoredTensor(key="matrix").read_into(checkpoint, (5, 0), out.to(torch.float64))
        with pytest.raises(ValueError, match=r"matrix: box at \(30, 0\) of \(8, 24\) is outside"):
            checkpoint.read("matrix", (30, 0), (8, 24))


@pytest.mark.parametrize(
    ("model_type", "name", "kind"),
    [
        ("olmo_hybrid", "model.layers.0.linear_attn.conv1d.weight", Concatenated),  # q, k, v
        ("hrm_text", "model.H_module.layers.0.self_attn.k_proj.weight", Chunked),  # gqkv_proj
        ("inkling2_text", "model.layers.1.mlp.experts.gate_up_proj", Interleaved),  # w13
    ],
)
def test_tensors_transformers_joins_cuts_or_reorders_are_read_by_boxes(
    tmp_path, model_type, name, kind
):
    """Folders written by save_pretrained in layouts transformers converts on loading: every tensor
    reads whole as the model holds it, and a box of the converted one as its slice."""
    from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
    from tests.coverage import save_tiny_model

    tokenizer = train_tokenizer(["hello world"], DEFAULT_VOCAB_SIZE, tmp_path / "tokenizer")
    model = save_tiny_model(model_type, tmp_path / "model", tokenizer)
    with Checkpoint(tmp_path / "model") as checkpoint:
        layout = StoredLayout(checkpoint, model)
        for key, tensor in model.state_dict().items():
            source = layout.source(key, {})
            whole = source.read(checkpoint, (0,) * tensor.dim(), tuple(tensor.shape))
            assert torch.equal(whole, tensor), key
        source, tensor = layout.source(name, {}), model.get_parameter(name)
        assert isinstance(source, kind) and source.shape(checkpoint) == tuple(tensor.shape)
        offset = (1, *(0,) * (tensor.dim() - 1))
        size = (tensor.shape[0] - 2, *tensor.shape[1:-1], tensor.shape[-1] // 2)
        box = tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))
        assert torch.equal(source.read(checkpoint, offset, size), tensor[box])
