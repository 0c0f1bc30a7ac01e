"""A model type whose own transformers class cannot be built from its config (DBRX in
transformers 5.23) is one problem before any rank starts, saying it is not supported with this
transformers version, not that the folder is broken."""

import json

from components.distributed.layout import ParallelDims
from recipes.checks import compose, resolve_model
from recipes.schema import validate

DBRX = {"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": 64, "n_heads": 4}


def test_a_model_transformers_cannot_build_is_one_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**DBRX, "n_layers": 2, "vocab_size": 384}))
    settings = validate(compose(["model=pretrained", f"model.pretrained_path={tmp_path}", "tp=2"]))
    _, _, found = resolve_model(settings, ParallelDims(tp=2), "cpu")
    (problem,) = [p for p in found if "dbrx" in p.message]
    assert problem.key == "model"
    assert problem.message.startswith("model type 'dbrx' is not supported with transformers 5.")
    assert "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'" in (
        problem.message
    )
