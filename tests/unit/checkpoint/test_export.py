"""export_hf on one process (a plain model): from_pretrained gives the same logits; tied, sharded,
tokenizer; the source folder's metadata byte-identical, a model card, the dtype asked for, user
files never deleted.

Exports of tensor- and data-parallel models on real ranks are in
tests/distributed/test_checkpoint.py.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from components.checkpoint.export import (
    INDEX_FILE,
    check_export_target,
    export_dtype,
    export_hf,
    metadata_files,
    model_card,
    source_dtype,
)
from components.checkpoint.manifest import MANIFEST
from components.models import build_causal_lm
from components.moe import RoutingBias
from recipes.tiny_models import tiny_config

TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_round_trips_through_from_pretrained(tmp_path, tied):
    config = tiny_config("llama", num_hidden_layers=1, tie_word_embeddings=tied)
    model = build_causal_lm(config, seed=3)
    out = export_hf(model, config, tmp_path / "model")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    with safe_open(out / "model.safetensors", framework="pt") as stored:
        assert ("lm_head.weight" in stored.keys()) is not tied
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert config.architectures is None  # the caller's config is not changed
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))


def test_sharded_export_with_tokenizer_replaces_an_earlier_export(tmp_path):
    config = tiny_config("llama", num_hidden_layers=1)
    export_hf(build_causal_lm(config, seed=1), config, tmp_path / "model")
    model = build_causal_lm(config, seed=2)
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    )
    out = export_hf(model, config, tmp_path / "model", tokenizer=tokenizer, max_shard_size="40KB")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    assert len(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == len(model.state_dict())
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    umask = os.umask(0)
    os.umask(umask)
    assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {
        0o666 & ~umask
    }  # as readable as any file
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("world") == 2


def source_folder(tmp_path, config, model) -> Path:
    """A Hugging Face folder as a user or the Hub would have it: weights, config, generation config,
    chat template, tokenizer files, a licence, a README of its own and a hidden file."""
    source = tmp_path / "source"
    export_hf(model, config, source)
    (source / MANIFEST).unlink()
    (source / "generation_config.json").write_text(
        '{\n  "bos_token_id": 1,\n  "temperature": 0.25\n}\n'
    )
    (source / "chat_template.jinja").write_bytes(
        "{% for m in messages %}<|{{ m.role }}|>\u00e9\r\n{% endfor %}".encode()
    )
    (source / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    (source / "LICENSE").write_bytes(b"\x00licence bytes\xff")
    (source / "README.md").write_text("the base model's own card")
    (source / ".gitattributes").write_text("*.safetensors filter=lfs")
    return source


def test_export_carries_source_metadata_byte_identical_and_a_model_card(tmp_path):
    config = tiny_config("llama", num_hidden_layers=1)
    model = build_causal_lm(config, seed=4)
    source = source_folder(tmp_path, config, model)
    out = export_hf(
        model,
        config,
        tmp_path / "hf",
        source_dir=source,
        recipe="recipes/finetune.py",
        config_yaml="tp: 2\noptim:\n  lr: 0.001\n",
        base_model="owner/base",
    )
    copied = ["LICENSE", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"]
    for name in copied:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*copied, "README.md", "config.json", "model.safetensors", MANIFEST]
    )
    card = (out / "README.md").read_text()
    assert "recipes/finetune.py" in card and 'base_model: "owner/base"' in card
    assert "```yaml\ntp: 2\noptim:\n  lr: 0.001\n```" in card
    local = model_card("recipes/finetune.py", None, "/models/mine", torch.bfloat16)
    assert (
        "base_model:" not in local
        and "- Base model: `/models/mine`" in local
        and "bfloat16" in local
    )
    assert metadata_files(source) == [source / name for name in copied]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.generation_config.temperature == 0.25
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_dtype_defaults_to_the_sources(tmp_path, dtype):
    config = tiny_config("llama", num_hidden_layers=1)
    model = build_causal_lm(config, seed=5)
    source = tmp_path / "source"
    export_hf(model, config, source, dtype=torch.bfloat16)
    assert source_dtype(source) == torch.bfloat16 and source_dtype(None) == torch.float32
    out = export_hf(model, config, tmp_path / "hf", source_dir=source, dtype=dtype)
    with safe_open(out / "model.safetensors", framework="pt") as stored:
        tensors = {name: stored.get_tensor(name) for name in stored.keys()}
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    assert torch.equal(
        tensors["model.norm.weight"], model.model.norm.weight.detach().to(torch.bfloat16)
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = export_hf(model, config, tmp_path / "fp32")  # built from config: fp32
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"
    assert (
        export_dtype(None, source) == torch.bfloat16
        and export_dtype("float16", source) == torch.float16
    )
    with pytest.raises(
        ValueError,
        match=r"^export dtype 'fp8' is not one of null \(the source's\), float32, bfloat16",
    ):
        export_dtype("fp8", None)


def test_export_refuses_a_folder_with_user_files_and_leaves_it_alone(tmp_path):
    config = tiny_config("llama", num_hidden_layers=1)
    model = build_causal_lm(config, seed=6)
    target = tmp_path / "hf"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files shardtune did not write \(notes.txt\)"):
        export_hf(model, config, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    (target / "notes.txt").unlink()
    export_hf(model, config, target)  # an empty folder is fine, and so is an earlier export
    export_hf(model, config, target)
    (target / "extra.safetensors").write_bytes(b"")
    assert check_export_target(target).endswith(
        "(extra.safetensors); move them away or choose another output_dir"
    )


def test_an_export_leaves_out_the_routing_bias_a_checkpoint_keeps(tmp_path):
    config = tiny_config("qwen3_moe", num_hidden_layers=1)
    model = build_causal_lm(config, seed=0)
    RoutingBias(model, ["model.layers.*.mlp.gate"], config.num_experts)
    assert "model.layers.0.mlp.gate.routing_bias" in model.state_dict()  # what DCP saves
    out = export_hf(model, config, tmp_path / "model")
    with safe_open(out / "model.safetensors", framework="pt") as stored:
        names = set(stored.keys())
    assert names == set(build_causal_lm(config, seed=0).state_dict())  # the family's own tensors
