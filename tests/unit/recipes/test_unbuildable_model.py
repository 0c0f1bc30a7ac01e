"""A model type whose own transformers class cannot be built from its config (DBRX in
transformers 5.23) is one problem before any rank starts, saying it is not supported with this
transformers version, not that the folder is broken."""

import json

from components.distributed.layout import ParallelDims
from components.models.checks import check_model
from recipes.compose import compose
from recipes.plan import model_choice, model_use
from recipes.validate import validate

DBRX = {"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": 64, "n_heads": 4}


def test_a_model_transformers_cannot_build_is_one_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**DBRX, "n_layers": 2, "vocab_size": 384}))
    settings = validate(compose(["model=pretrained", f"model.pretrained_path={tmp_path}", "tp=2"]))
    use = model_use(settings, "cpu")
    found = check_model(model_choice(settings), use, ParallelDims(tp=2)).problems
    (problem,) = [p for p in found if "dbrx" in p.message]
    assert problem.key == "model"
    assert problem.message.startswith("model type 'dbrx' is not supported with transformers 5.")
    assert "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'" in (
        problem.message
    )
