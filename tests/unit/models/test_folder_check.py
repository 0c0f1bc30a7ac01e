"""A model folder is checked before any rank loads it: an index naming files outside the folder and
a checkpoint without a tensor the model needs are each one phrase naming the cause."""

import json

import pytest
from safetensors.torch import load_file, save_file
from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

import components.models.checkpoint as checkpoint_module
from components.models import build_causal_lm, meta_causal_lm
from components.models.checkpoint import INDEX_FILE, Checkpoint, index_errors
from components.models.folder_check import check_model_folder
from recipes.tiny_models import tiny_config


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """An untied tiny Llama saved as two shards with an index, and its config."""
    config = tiny_config("llama", tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("untied")
    build_causal_lm(config, seed=0).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / INDEX_FILE).is_file()
    return folder, config


def copy_of(folder, into):
    into.mkdir()
    for path in folder.iterdir():
        (into / path.name).write_bytes(path.read_bytes())
    return into


def test_a_sound_sharded_folder_passes(untied):
    folder, config = untied
    assert index_errors(folder) == []
    assert check_model_folder(folder, meta_causal_lm(config)) == []


def test_an_index_naming_a_file_outside_the_folder_is_refused(untied, tmp_path):
    folder, config = untied
    copy = copy_of(folder, tmp_path / "model")
    index = json.loads((copy / INDEX_FILE).read_text())
    moved = index["weight_map"]["lm_head.weight"]
    (copy / moved).rename(tmp_path / moved)  # the shard exists, but beside the folder
    index["weight_map"] = {
        name: f"../{file}" if file == moved else file for name, file in index["weight_map"].items()
    }
    (copy / INDEX_FILE).write_text(json.dumps(index))
    errors = check_model_folder(copy, meta_causal_lm(config))
    assert len(errors) == 1 and f"names '../{moved}'" in errors[0], errors
    assert "outside the model folder" in errors[0]
    with pytest.raises(ValueError, match="outside the model folder"):
        Checkpoint(copy)  # the loader refuses it too


def test_an_untied_folder_without_lm_head_is_refused_naming_it(tmp_path):
    config = tiny_config("llama", tie_word_embeddings=False)
    build_causal_lm(config, seed=0).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    errors = check_model_folder(tmp_path, meta_causal_lm(config))
    assert len(errors) == 1 and "lacks lm_head.weight (config.json has" in errors[0], errors


def test_a_tied_folder_without_lm_head_passes(tmp_path):
    config = tiny_config("llama", tie_word_embeddings=True)
    build_causal_lm(config, seed=0).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert check_model_folder(tmp_path, meta_causal_lm(config)) == []


def test_a_conversion_the_loader_cannot_slice_is_named_as_unsupported(tmp_path, monkeypatch):
    """A per-expert layout that transformers converts with an operation we do not read by slices
    (a transpose here, in place of qwen3_moe's own merge) is refused as unsupported, not as a
    folder that lacks tensors."""
    config = tiny_config("qwen3_moe")
    build_causal_lm(config, seed=0).save_pretrained(tmp_path)
    transposed = WeightConverter(
        source_patterns="mlp.experts.*.down_proj.weight",
        target_patterns="mlp.experts.down_proj",
        operations=[MergeModulelist(dim=0), Transpose(1, 2)],
    )
    rules = checkpoint_module._conversions
    monkeypatch.setattr(
        checkpoint_module,
        "_conversions",
        lambda model: [r for r in rules(model) if "down_proj" not in str(r)] + [transposed],
    )
    errors = check_model_folder(tmp_path, meta_causal_lm(config))
    assert errors == [
        f"model folder {tmp_path}: model.layers.0.mlp.experts.down_proj is stored as "
        "model.layers.0.mlp.experts.0.down_proj.weight (and 7 more), which transformers converts "
        "with MergeModulelist(dim=0), Transpose: that checkpoint layout of model type "
        "'qwen3_moe' is not supported yet (shardtune reads per-expert tensors merged by "
        "MergeModulelist(dim=0), then Concatenate(dim=1); tensors joined by Concatenate(dim=0); "
        "one tensor cut by Chunk(dim=0) or reordered by Interleave)"
    ]
