"""A folder whose causal-LM class attends to later tokens unless a config flag says otherwise (the
BERT family's ``is_decoder``, XLM's ``causal``) is trained with that flag on: the recipe's
next-token objective must not see the next token. Real tiny models of transformers' own classes."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from components.models.load import causal_flags
from recipes.tiny_models import tiny_config

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CONFIGS = {
    "roberta": lambda: AutoConfig.for_model("roberta", vocab_size=64, **SMALL),
    "xmod": lambda: AutoConfig.for_model("xmod", vocab_size=64, default_language="en_XX", **SMALL),
    "xlm": lambda: AutoConfig.for_model(
        "xlm", vocab_size=64, emb_dim=32, n_layers=2, n_heads=2, n_langs=1
    ),
}


def sees_later_tokens(config) -> bool:
    """Whether position 1's logits move when only positions 2 and 3 change (dropout off)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        first = model(torch.tensor([[5, 6, 7, 8]])).logits[0, :2]
        second = model(torch.tensor([[5, 6, 9, 10]])).logits[0, :2]
    return not torch.equal(first, second)


@pytest.mark.parametrize(
    ("model_type", "flag"), [("roberta", "is_decoder"), ("xmod", "is_decoder"), ("xlm", "causal")]
)
def test_a_model_that_attends_both_ways_is_trained_with_its_causal_flag(model_type, flag):
    config = CONFIGS[model_type]()
    assert sees_later_tokens(config)  # as the folder says: the objective could be read off
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    assert causal_flags(config, meta) == [flag] and getattr(config, flag) is True
    assert not sees_later_tokens(config)


def test_a_decoder_is_left_as_it_is():
    config = tiny_config("llama")
    before = config.to_dict()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    assert causal_flags(config, meta) == [] and config.to_dict() == before
