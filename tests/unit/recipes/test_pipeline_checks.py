"""The pp keys' checks: each layout pipeline parallelism does not compose with yet is one problem
that says so, before any rank starts; a layout that fits has none."""

import pytest

from components.models.checks import stage_problems
from recipes.checks import check_sizes, layout_model_problems
from recipes.compose import compose
from recipes.plan import model_facts
from recipes.tiny_models import tiny_config
from recipes.validate import validate

FITS = ["pp=2", "train.val_every=0"]


def problems_of(overrides: list[str], family: str = "llama", **sizes) -> list[str]:
    settings = validate(compose([f"model={family}", *overrides]))
    dims, found = check_sizes(settings, "cpu")
    facts = model_facts(settings, tiny_config(family, **sizes))
    found += layout_model_problems(settings, dims, facts)
    return [f"{problem.key}: {problem.message}" for problem in found]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["cp=2"], "cp: pp=2 with cp=2 is not supported yet: use pp=1, or cp=1"),
        (["train.compile=true"], "train.compile: pp=2 with train.compile=true is not supported"),
        (["pp=4", "pp_schedule=gpipe"], "pp: 4 pipeline stages need 2 decoder layers or more"),
        (
            ["train.global_batch_size=8", "train.micro_batch_size=8"],
            "train.global_batch_size: pp_schedule=1f1b needs pp=2 or more micro-batches per step, "
            "this step has 1",
        ),
        (
            ["pp_schedule=interleaved_1f1b"],
            "pp_schedule: pp_schedule=interleaved_1f1b with pp_stages_per_rank=1: use "
            "interleaved_1f1b with 2 stages per rank or more, or gpipe or 1f1b with 1",
        ),
        (
            [
                "pp_schedule=interleaved_1f1b",
                "pp_stages_per_rank=2",
                "train.global_batch_size=12",
                "train.micro_batch_size=4",
            ],
            "pp_schedule=interleaved_1f1b needs a multiple of pp=2 micro-batches per step, this "
            "step has 3",
        ),
        (
            [
                "pp_schedule=interleaved_1f1b",
                "pp_stages_per_rank=2",
                "dp=2",
                "train.micro_batch_size=2",
            ],
            "dp: pp=2 with interleaved stages and dp=2 is not supported yet: use pp=1, or dp=1",
        ),
    ],
)
def test_what_pp_does_not_compose_with_is_one_problem(overrides, expected):
    layers = 1 if "pp=4" in overrides else 2
    found = problems_of([*FITS, *overrides], num_hidden_layers=layers)
    assert len(found) == 1 and expected in found[0], found


def test_pp_refuses_moe_models_and_takes_tied_embeddings():
    (moe,) = problems_of(FITS, "qwen3_moe")
    assert moe == "model: pp=2 with an MoE model is not supported yet: use pp=1, or a dense model"
    assert problems_of(FITS, tie_word_embeddings=True) == []


def test_layouts_that_fit_have_no_problem():
    assert problems_of(FITS) == []
    assert problems_of([*FITS, "pp_schedule=gpipe", "train.micro_batch_size=8"]) == []
    assert problems_of([*FITS, "tp=2", "dp=2", "train.micro_batch_size=4"]) == []
    assert problems_of([*FITS, "dry_run=true"]) == []  # a dry run plans pp (tests/e2e)
    assert problems_of([*FITS, "peft=lora", "train.val_every=5"]) == []


def test_a_decoder_with_parameters_beside_its_layers_is_refused_with_pp():
    """OPT's learned positions (``embed_positions``) and its ``final_layer_norm`` sit beside its
    layers: kept on every stage, each stage would add the positions again. A Llama decoder holds
    its layers, embedding and norm only (its rotary embedding has no parameters)."""
    from components.models import meta_causal_lm
    from tests.coverage import tiny_config as coverage_config

    settings = validate(compose(["model=llama", *FITS]))
    dims, _ = check_sizes(settings, "cpu")
    opt, llama = coverage_config("opt"), tiny_config("llama")
    found = stage_problems(opt, meta_causal_lm(opt), dims.pp)
    assert [f"{problem.key}: {problem.message}" for problem in found] == [
        "pp: pp=2 with model type 'opt' is not supported yet (embed_positions, final_layer_norm "
        "beside its decoder layers, embedding and final norm (norm)): use pp=1"
    ]
    assert stage_problems(llama, meta_causal_lm(llama), dims.pp) == []


def test_a_decoder_that_changes_its_input_embeddings_is_refused_with_pp(monkeypatch):
    """Granite's decoder multiplies the embeddings it is handed (``embedding_multiplier``), on every
    stage: the stages after the first skip that scale. A scale the pipeline does not know of would
    be applied again on every stage: refused, found by running the decoder without its layers."""
    from components.distributed import pipeline
    from components.models import meta_causal_lm
    from tests.coverage import tiny_config as coverage_config

    settings = validate(compose(["model=llama", *FITS]))
    dims, _ = check_sizes(settings, "cpu")
    granite = coverage_config("granite")
    granite.embedding_multiplier = 3.0
    assert stage_problems(granite, meta_causal_lm(granite), dims.pp) == []
    monkeypatch.setattr(pipeline, "EMBEDDING_SCALES", {})
    found = stage_problems(granite, meta_causal_lm(granite), dims.pp)
    assert [f"{problem.key}: {problem.message}" for problem in found] == [
        "pp: pp=2 with model type 'granite' is not supported yet (its decoder's forward changes "
        "the input embeddings before its first layer): use pp=1"
    ]


def test_a_final_norm_that_also_runs_on_the_embeddings_is_refused_with_pp():
    """NanoChat's decoder runs its (weightless) final norm on the embeddings too: a first stage
    without the norm would skip it, a last stage would apply it to an earlier stage's hidden states
    (the coverage sweep: pp=2 2.7e-2 from tp=1). Its norm is idempotent, so the layerless middle
    stage cannot tell: counted on a layerless last stage."""
    from components.models import meta_causal_lm
    from tests.coverage import tiny_config as coverage_config

    settings = validate(compose(["model=llama", *FITS]))
    dims, _ = check_sizes(settings, "cpu")
    nanochat = coverage_config("nanochat")
    found = stage_problems(nanochat, meta_causal_lm(nanochat), dims.pp)
    assert [f"{problem.key}: {problem.message}" for problem in found] == [
        "pp: pp=2 with model type 'nanochat' is not supported yet (its final norm also runs on "
        "the input embeddings, before its first layer): use pp=1"
    ]
