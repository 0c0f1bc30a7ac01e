"""Plan checks that need no process group: everything wrong is reported at once, before sharding."""

from types import SimpleNamespace

import pytest
from transformers import MiniCPM3Config, Phi3Config

from components.distributed.layout import tp_size_errors, tp_sizes
from components.distributed.tp_plan import _resolve, check_plan
from components.models import meta_causal_lm
from components.models.families import FAMILIES, plan_for
from recipes.tiny_models import tiny_config


def test_every_problem_is_listed_together():
    config = tiny_config(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=130
    )
    plan = plan_for(config) | {"model.layers.*.mlp.typo_proj": "colwise", "model.norm": "diagonal"}
    _, errors = check_plan(meta_causal_lm(config), config, plan, tp=4)
    assert errors == [
        "plan pattern 'model.layers.*.mlp.typo_proj' (colwise) matches no module of "
        "LlamaForCausalLM",
        "model.norm: unknown tensor-parallel style 'diagonal'; known: ['all_reduce', "
        "'attention_input', 'colwise', 'colwise_gather_output', 'embedding_colwise', "
        "'embedding_rowwise', 'gather_sequence', 'local_heads', 'local_params', "
        "'local_params_all_reduce', 'mla_kv_a_proj', 'mlp_input', "
        "'replicate', 'replicated_with_grad_allreduce', 'rowwise', 'rowwise_local_heads', "
        "'rowwise_split_input', "
        "'sequence_parallel', 'sequence_parallel_parameters', 'vocab_parallel']",
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


def phi3() -> Phi3Config:
    return Phi3Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        vocab_size=64,
        pad_token_id=0,
    )


def test_hf_expert_styles_outside_the_experts_are_refused_by_name():
    config = phi3()
    plan = plan_for(config) | {"model.layers.*.mlp.gate_up_proj": "packed_colwise"}
    _, errors = check_plan(meta_causal_lm(config), config, plan, tp=2)
    assert errors == [
        "model.layers.0.mlp.gate_up_proj: 'packed_colwise' is Hugging Face's tensor parallelism "
        "inside MoE experts, for experts only: experts are split by expert parallelism here "
        "(their plan entries are left out)"
    ]
    assert check_plan(meta_causal_lm(config), config, plan_for(config), tp=2)[1] == []


def test_a_sharded_parameter_makes_its_module_local_and_other_styles_are_refused():
    config = phi3()
    model, plan = meta_causal_lm(config), plan_for(config)
    bias = {"model.layers.*.post_attention_layernorm.weight": "colwise"}
    resolved, errors, notes = _resolve(model, plan | bias, config)
    assert errors == [] and resolved["model.layers.0.post_attention_layernorm"] == "local_params"
    assert notes == [
        "model.layers.0.post_attention_layernorm: local_params added, its parameter "
        "model.layers.0.post_attention_layernorm.weight is sharded"
    ]
    packed = {"model.layers.*.post_attention_layernorm.weight": "packed_colwise"}
    assert _resolve(model, plan | packed, config)[1] == [
        "plan shards the parameter model.layers.0.post_attention_layernorm.weight of "
        "Phi3ForCausalLM with 'packed_colwise': a parameter takes only ['colwise', 'rowwise']"
    ]
    whole = {"model.layers.*.input_layernorm": "local_params"}
    assert _resolve(model, plan | whole, config)[1] == [
        "model.layers.0.input_layernorm (local_params): the plan does not shard its parameter "
        "model.layers.0.input_layernorm.weight, whose gradient on local tensors it leaves "
        "undefined (partial or whole over TP)"
    ]
    weight = {"model.layers.*.self_attn.qkv_proj.weight": "colwise"}
    assert _resolve(model, plan | weight, config)[1] == [
        "plan shards the parameter model.layers.0.self_attn.qkv_proj.weight and gives its module "
        "model.layers.0.self_attn.qkv_proj 'colwise_gather_output': its module needs "
        "'local_params'"
    ]


def test_own_plan_patterns_for_layer_kinds_the_model_lacks_are_notes():
    config = phi3()
    config.base_model_tp_plan = {
        **config.base_model_tp_plan,
        "layers.*.block_sparse_moe.experts": "moe_tp_experts",
    }
    model, plan = meta_causal_lm(config), plan_for(config)
    _, errors, notes = _resolve(model, plan, config)
    assert errors == []
    assert notes == [
        "plan pattern 'model.layers.*.block_sparse_moe.experts' (moe_tp_experts) ignored: "
        "Phi3ForCausalLM has no such layers"
    ]
    # ours (or a user's) matching nothing is an error, as is an own plan matching nothing at all
    typo = {"model.layers.*.mlp.typo_proj": "colwise"}
    assert _resolve(model, plan | typo, config)[1] == [
        "plan pattern 'model.layers.*.mlp.typo_proj' (colwise) matches no module of Phi3ForCausalLM"
    ]
    config.base_model_tp_plan = {"layers.*.feed_forward.w1": "colwise"}
    assert len(_resolve(model, plan_for(config), config)[1]) == 1


def test_all_reduce_over_a_rowwise_child_is_left_out():
    config = tiny_config("llama")
    plan = plan_for(config) | {"model.layers.*.mlp": "all_reduce"}
    resolved, errors, notes = _resolve(meta_causal_lm(config), plan, config)
    assert errors == [] and resolved["model.layers.0.mlp"] == "replicate"
    assert notes[0] == (
        "model.layers.0.mlp: all_reduce left out, its rowwise model.layers.0.mlp.down_proj sums "
        "the output"
    )


def test_a_hf_plan_of_gathered_then_split_projections_fits():
    config = phi3()
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


def test_mla_with_sequence_parallelism_is_refused():
    config = MiniCPM3Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        vocab_size=64,
        q_lora_rank=16,
        kv_lora_rank=8,
        pad_token_id=0,
    )
    model = meta_causal_lm(config)
    assert check_plan(model, config, plan_for(config, True, model), tp=2)[1] == [
        "sequence parallelism with MLA attention (mla_kv_a_proj) is not supported; use sp=false"
    ]
    assert check_plan(model, config, plan_for(config, False, model), tp=2)[1] == []


def test_tp_must_divide_every_layers_size_of_a_per_layer_list():
    """Gemma 3n gives each layer its own ``intermediate_size``: tp must divide each."""
    config = SimpleNamespace(num_attention_heads=4, intermediate_size=[128, 130])
    assert tp_size_errors(tp_sizes(config), 2) == []
    assert tp_size_errors(tp_sizes(config), 4) == [
        "tp (4) must divide intermediate_size ([128, 130])"
    ]


def test_inkling_all_reduce_runs_on_its_sharded_parameters_and_its_normed_embedding_is_whole():
    """Inkling's shared experts: 3-D parameters split by the plan under an ``all_reduce`` module,
    which then runs on their slices and sums its output; its embedding holds a norm, so it is not
    split, and sequence parallelism (which would take its whole output for a shard) is refused."""
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("inkling_text")
    model = meta_causal_lm(config)
    resolved, errors = check_plan(model, config, plan_for(config, False, model), tp=2)
    assert errors == [] and resolved["model.embed_tokens"] == "replicate"
    shared = {name: style for name, style in resolved.items() if ".1.mlp.shared_experts" in name}
    assert shared == {
        "model.layers.1.mlp.shared_experts": "local_params_all_reduce",
        "model.layers.1.mlp.shared_experts.gate_proj": "colwise",
        "model.layers.1.mlp.shared_experts.up_proj": "colwise",
        "model.layers.1.mlp.shared_experts.down_proj": "rowwise",
    }
    assert check_plan(model, config, plan_for(config, True, model), tp=2)[1] == [
        "sequence parallelism with a replicated embedding (model.embed_tokens, not split: it "
        "holds modules of its own, such as a norm after the lookup) is not supported; use sp=false"
    ]
