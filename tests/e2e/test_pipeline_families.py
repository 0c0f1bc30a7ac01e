"""Pipeline stages compute what the model computes, for families whose forward does more than
embed, run layers and project: Cohere and Cohere 2 scale the logits, Granite multiplies the
embeddings and divides the logits, Gemma 2 and Gemma 3 softcap the logits and read per-layer
attention kinds (and Gemma 3 per-layer rotary bases) by the layer's position. Each a tiny model of
its own config class with those settings away from their defaults (a sliding window shorter than
the rows, so the kinds differ), written by ``save_pretrained``, trained through the command line at
pp=2 and at pp=1 with SGD: losses and grad norms within 1e-5 over 3 steps; pp=1's first loss is
the Hugging Face model's own. Granite-MoE is refused at pp=2 in one line (an MoE model).

By default one family per kind of post-processing runs: Cohere 2 (logit scaling, layer kinds),
Granite (embedding multiplier) and Gemma 3 (softcapping, layer kinds, rotary bases); Llama, Cohere
and Gemma 2, which repeat those paths, run under ``-m sweep``.
"""

import json

import pytest

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.coverage import tiny_config
from tests.saved_models import BATCH, MICRO, SEQ_LEN, first_loss, recipe, save_model
from tests.selection import selected_params

SETTINGS = {  # model type -> its forward's settings, away from their defaults
    "llama": {},
    "cohere": {"logit_scale": 0.5},
    "cohere2": {"logit_scale": 0.5, "sliding_window": 8},
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 4.0},
    "gemma2": {"final_logit_softcapping": 2.0, "sliding_window": 8},
    "gemma3_text": {"final_logit_softcapping": 2.0, "sliding_window": 8},
}
MOE = "granitemoe"
SWEEP = ("llama", "cohere", "gemma2")  # their paths again: plain, logit scaling, softcapping


def tiny_folder(model_type: str, root, tokenizer):
    config = tiny_config(model_type)
    for name, value in SETTINGS.get(model_type, {"embedding_multiplier": 3.0}).items():
        setattr(config, name, value)
    return save_model(root / model_type, config, tokenizer)


@pytest.fixture(scope="module")
def folders(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_families")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    types = [*selected_params(request, "model_type"), MOE]
    found = {name: tiny_folder(name, root, tokenizer) for name in types}
    return found | {"cache": root / "cache", "runs": root / "runs"}


def curve(folders, model_type: str, *layout: str) -> list[tuple[float, float]]:
    output_dir = folders["runs"] / model_type / "_".join(layout).replace("=", "")
    result = recipe(folders, model_type, output_dir, "optim=sgd", *layout)
    assert result.returncode == 0, result.stderr[-3000:]
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [(record["loss"], record["grad_norm"]) for record in records]


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(name, marks=pytest.mark.sweep) if name in SWEEP else name for name in SETTINGS],
)
def test_pp2_trains_the_model_pp1_trains(folders, model_type):
    whole, staged = curve(folders, model_type, "pp=1"), curve(folders, model_type, "pp=2")
    assert len(whole) == len(staged) == 3
    for (loss, norm), (want_loss, want_norm) in zip(staged, whole, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    own = first_loss(folders[model_type], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert whole[0][0] == pytest.approx(own, rel=1e-6)


def test_granite_moe_is_refused_at_pp2_in_one_line(folders):
    result = recipe(folders, MOE, folders["runs"] / MOE, "pp=2")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: pp=2 with an MoE model is not supported yet: use pp=1, or a dense model"
    ]
