"""Plan checks that need no process group: everything wrong is reported at once, before sharding."""

import pytest
from transformers import Phi3Config

from components.distributed.tp_plan import check_plan
from components.models import meta_causal_lm, tiny_config
from components.models.families import FAMILIES, plan_for


def test_every_problem_is_listed_together():
    config = tiny_config(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=130
    )
    plan = plan_for(config) | {"model.layers.*.mlp.typo_proj": "colwise", "model.norm": "diagonal"}
    _, errors = check_plan(meta_causal_lm(config), config, plan, tp=4)
    assert errors == [
        "plan pattern 'model.layers.*.mlp.typo_proj' (colwise) matches no module of "
        "LlamaForCausalLM",
        "model.norm: unknown tensor-parallel style 'diagonal'; known: ['attention_input', "
        "'colwise', "
        "'colwise_gather_output', 'embedding_rowwise', 'gather_sequence', 'local_heads', "
        "'mlp_input', "
        "'replicate', "
        "'replicated_with_grad_allreduce', 'rowwise', 'rowwise_split_input', 'sequence_parallel', "
        "'vocab_parallel']",
        "tp (4) must divide num_attention_heads (6)",
        "tp (4) must divide num_key_value_heads (3)",
        "tp (4) must divide intermediate_size (130)",
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_our_plans_fit_the_tiny_models(family, tp):
    config = tiny_config(family)
    resolved, errors = check_plan(
        meta_causal_lm(config), config, plan_for(config, sequence_parallel=True), tp
    )
    assert errors == []
    assert resolved["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert resolved["model.layers.0.input_layernorm"] == "sequence_parallel"


def test_qwen3_marks_qk_norms_sum_and_llama_has_none():
    q_norm = FAMILIES["qwen3"].plan["model.layers.*.self_attn.q_norm"]
    assert q_norm == "replicated_with_grad_allreduce"
    assert not any("q_norm" in pattern for pattern in FAMILIES["llama"].plan)


def test_a_hf_plan_of_gathered_then_split_projections_fits():
    config = Phi3Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        vocab_size=64,
        pad_token_id=0,
    )
    resolved, errors = check_plan(meta_causal_lm(config), config, plan_for(config), tp=2)
    assert errors == []
    assert resolved["model.layers.0.self_attn.o_proj"] == "rowwise_split_input"


def test_unknown_model_type_without_a_hf_plan_is_an_error():
    class Bare:
        model_type = "bare"
        base_model_tp_plan = None

    with pytest.raises(ValueError, match="no tensor-parallel plan for model type 'bare'"):
        plan_for(Bare())


def test_sequence_parallel_needs_the_vocabulary_sharded():
    config = tiny_config("llama", vocab_size=257)
    _, errors = check_plan(
        meta_causal_lm(config), config, plan_for(config, sequence_parallel=True), tp=2
    )
    assert errors == ["sequence parallelism needs tp (2) to divide vocab_size (257); use sp=false"]
    assert (
        check_plan(meta_causal_lm(config), config, plan_for(config), tp=2)[1] == []
    )  # replicated fallback
