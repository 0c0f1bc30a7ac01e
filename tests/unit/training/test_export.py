"""export_hf on one process (a plain model): from_pretrained gives the same logits; tied, sharded, tokenizer.

Exports of tensor- and data-parallel models on real ranks are in tests/distributed/test_checkpoint.py.
"""

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from components.models import build_causal_lm, tiny_config
from components.training.export import INDEX_FILE, export_hf

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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")))
    out = export_hf(model, config, tmp_path / "model", tokenizer=tokenizer, max_shard_size="40KB")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    assert len(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == len(model.state_dict())
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("world") == 2
