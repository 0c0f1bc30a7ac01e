"""The table of model families: every family conf/ names is in it, and each family's plan, experts
and routers fit the modules of its tiny model."""

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import GPTNeoXConfig, Phi3Config, Qwen2MoeConfig

from components.distributed.tp_plan import check_plan
from components.models import meta_causal_lm
from components.models.configs import build_config
from components.models.families import FAMILIES, moe_patterns, plan_for, unbuilt_patterns
from recipes.tiny_models import MODEL_CONF_DIR, tiny_config

TINY = OmegaConf.to_container(OmegaConf.load(MODEL_CONF_DIR / "llama.yaml").config)


def family_config(model_type: str):
    """The tiny config of ``conf/model/<model_type>.yaml``, else one of llama's tiny sizes."""
    if (MODEL_CONF_DIR / f"{model_type}.yaml").exists():
        return tiny_config(model_type)
    return build_config(model_type, TINY)


def conf_model_groups() -> dict[str, dict]:
    groups = {}
    for path in sorted(MODEL_CONF_DIR.glob("*.yaml")):
        node = OmegaConf.load(path)
        group = node.get("model", node)  # smollm2.yaml: @package _global_
        groups[path.stem] = OmegaConf.to_container(group)
    return groups


def test_every_family_conf_names_is_in_the_table_and_takes_its_moe_modules_from_it():
    groups = conf_model_groups()
    assert {"llama", "qwen3", "qwen3_moe", "mixtral", "pretrained"} <= set(groups)
    for name, group in groups.items():
        assert group["family"] is None or group["family"] in FAMILIES, name
        assert (group["experts"], group["routers"]) == (None, None), name  # not a second copy


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_config_class_is_the_family_of_its_key(model_type):
    config_class = FAMILIES[model_type].config_class()
    assert config_class.__name__ == FAMILIES[model_type].config_name
    assert config_class.model_type == model_type


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_plan_fits_the_tiny_model_at_tp_1_2_and_4(model_type, sequence_parallel):
    config, family = family_config(model_type), FAMILIES[model_type]
    meta = meta_causal_lm(config)
    plan = plan_for(config, sequence_parallel)
    assert set(family.plan.items()) <= set(plan.items())
    for tp in (1, 2, 4):
        _, errors = check_plan(meta, config, plan, tp, (*family.experts, *family.routers))
        assert errors == [], (tp, errors)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_experts_and_routers_match_modules_and_only_moe_families_have_them(model_type):
    family = FAMILIES[model_type]
    names = [name for name, _ in meta_causal_lm(family_config(model_type)).named_modules()]
    for pattern in (*family.experts, *family.routers):
        assert fnmatch.filter(names, pattern), pattern
    is_moe = any(".experts" in name for name in names)
    assert family.moe == is_moe
    assert bool(family.routers) == is_moe


def test_null_patterns_are_the_familys_and_a_list_overrides_them():
    experts, routers = FAMILIES["mixtral"].experts, FAMILIES["mixtral"].routers
    mixtral = family_config("mixtral")
    assert moe_patterns(mixtral, None, None) == (experts, routers)
    assert moe_patterns(mixtral, ["model.layers.*.moe.e"], []) == (("model.layers.*.moe.e",), ())
    assert moe_patterns(family_config("llama"), None, None) == ((), ())
    phi3 = Phi3Config(
        **{**TINY, "vocab_size": 256}, pad_token_id=0
    )  # not in the table: dense, from structure
    assert moe_patterns(phi3, None, None) == ((), ())


def test_the_table_cannot_be_changed_in_place():
    with pytest.raises(TypeError):
        FAMILIES["llama"].plan["lm_head"] = "replicate"
    with pytest.raises(TypeError):
        FAMILIES["gpt2"] = FAMILIES["llama"]


def test_reading_the_table_imports_no_model_code():
    """Imported on its own (as ``--help`` may), the table module imports neither torch nor
    transformers: config classes are resolved by name when asked for."""
    source = Path(__file__).resolve().parents[3] / "components" / "models" / "families.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('families', {str(source)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert module.FAMILIES['qwen3_moe'].moe\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_a_models_own_plan_leaves_experts_to_ep_and_unbuilt_layer_kinds_out():
    """Qwen2-MoE's own plan shards its experts (``packed_colwise``, ``moe_tp_experts``) and names a
    dense MLP every layer of this config lacks: the experts are left to expert parallelism, the
    dense MLP's patterns are listed for the plan report's note, and what is left fits."""
    config = Qwen2MoeConfig(**{**TINY, "vocab_size": 256}, num_experts=4, moe_intermediate_size=32)
    model = meta_causal_lm(config)
    plan = plan_for(config, model=model)
    assert not [pattern for pattern in plan if ".experts" in pattern]
    assert unbuilt_patterns(config, model) == [
        "model.layers.*.mlp.gate_proj",
        "model.layers.*.mlp.up_proj",
        "model.layers.*.mlp.down_proj",
    ]
    experts, routers = moe_patterns(config, None, None)
    assert check_plan(model, config, plan, tp=2, moe_modules=(*experts, *routers))[1] == []


def test_a_models_own_plan_is_placed_under_its_base_model_and_its_vocabulary_modules():
    """GPT-NeoX's plan is relative to ``gpt_neox`` (its ``base_model_prefix``), and its embedding
    is ``gpt_neox.embed_in``: the plan names it, and every pattern fits."""
    config = GPTNeoXConfig(**{**TINY, "vocab_size": 256})
    model = meta_causal_lm(config)
    plan = plan_for(config, model=model)
    assert plan["gpt_neox.layers.*.attention.query_key_value"] == "colwise"
    assert plan["gpt_neox.embed_in"] == "embedding_rowwise" and plan["lm_head"] == "vocab_parallel"
    assert check_plan(model, config, plan, tp=2)[1] == []


def test_own_plans_that_compute_something_else_are_corrected():
    """Doge's dt_proj gives one value per KV head from all of them: summed rowwise, each rank keeps
    its heads' (with ``A``'s slice), as its attention needs. Gemma 3n's MLPs with activation
    sparsity take statistics over the whole intermediate size: they stay whole, the others split."""
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("doge")
    model = meta_causal_lm(config)
    resolved, errors = check_plan(model, config, plan_for(config, model=model), tp=2)
    assert errors == [] and resolved["model.layers.0.self_attn.A"] == "colwise"
    assert resolved["model.layers.0.self_attn"] == "local_params"
    assert resolved["model.layers.1.self_attn.dt_proj"] == "rowwise_local_heads"
    config = coverage_config("gemma3n_text")
    assert config.activation_sparsity_pattern == [0.95, 0.0]
    model = meta_causal_lm(config)
    resolved, errors = check_plan(model, config, plan_for(config, model=model), tp=2)
    assert errors == [] and not [name for name in resolved if ".0.mlp" in name]
    assert resolved["model.layers.1.mlp.gate_proj"] == "colwise"


def test_sequence_parallelism_is_placed_from_every_layer_kind_or_refused():
    """Under sp: the norms of every kind of layer, by name (OLMo Hybrid's post-norms, not
    Nemotron-H's gated norm inside its Mamba mixer); a sublayer that does not end rowwise runs on
    whole tokens (Qwen3-Next's linear attention); a block's or the model's own parameters (Doge's
    residual scales, Zaya's input scale) and modules of 1-D parameters with two inputs become
    replicated DTensors; modules beside the layers on the embedding's output (Gemma 4's
    per-layer inputs) are refused in one line."""
    from tests.coverage import tiny_config as coverage_config

    def sequence_plan(model_type: str) -> dict[str, str]:
        config = coverage_config(model_type)
        model = meta_causal_lm(config)
        plan = plan_for(config, True, model)
        assert check_plan(model, config, plan, tp=2)[1] == []
        return plan

    olmo = sequence_plan("olmo_hybrid")
    assert olmo["model.layers.1.post_feedforward_layernorm"] == "sequence_parallel"
    assert olmo["model.layers.0.linear_attn"] == "gather_sequence"
    nemotron = sequence_plan("nemotron_h")
    assert nemotron["model.layers.0.norm"] == "sequence_parallel"
    assert not [name for name in nemotron if "mixer.norm" in name]
    assert sequence_plan("qwen3_next")["model.layers.0.linear_attn"] == "gather_sequence"
    assert sequence_plan("doge")["model.layers.1"] == "sequence_parallel_parameters"
    zaya = sequence_plan("zaya")  # its model's input scale, its two-input residual scaling
    assert zaya["model"] == "sequence_parallel_parameters"
    assert zaya["model.layers.0.post_mlp_residual_scale"] == "sequence_parallel_parameters"
    config = coverage_config("gemma4_text")
    with pytest.raises(ValueError) as refused:
        plan_for(config, True, meta_causal_lm(config))
    assert str(refused.value) == (
        "sequence parallelism with model.embed_tokens_per_layer, model.per_layer_model_projection "
        "(modules beside the decoder layers that the plan does not split, which would meet "
        "sequence shards) is not supported; use sp=false"
    )


def test_a_derived_plan_does_not_split_an_mlps_fused_input_projection():
    """ModernBERT's MLP reads the hidden size into ``Wi``, twice as wide as ``Wo``'s input, and cuts
    it in two after it: split by columns, a rank would hold only halves of one kind. Persimmon's
    fused q/k/v (each head's q, k and v together) is split by heads as before."""
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("modernbert-decoder")
    with pytest.raises(ValueError, match=r"cannot place model\.layers\.\*\.mlp\.Wi \(wider than "):
        plan_for(config, model=meta_causal_lm(config))
    config = coverage_config("persimmon")
    plan = plan_for(config, model=meta_causal_lm(config))
    assert plan["model.layers.*.self_attn.query_key_value"] == "colwise"


def test_a_derived_plan_finds_deeper_layers_and_a_blocks_own_mlp_or_says_why_not():
    """OPT's layers are ``model.decoder.layers`` and its MLP the block's own ``fc1``/``fc2``; a type
    measured to fail on the derivation (bloom's ALiBi, TrOCR's reshape) is refused with the reason;
    sequence parallelism still looks for the layers beside the embeddings only, and refuses XGLM
    (its sinusoidal positions meet the sequence shards whole)."""
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("opt")
    model = meta_causal_lm(config)
    plan = plan_for(config, model=model)
    assert plan["model.decoder.layers.*.fc1"] == "colwise"
    assert plan["model.decoder.layers.*.fc2"] == "rowwise"
    assert plan["model.decoder.layers.*.self_attn.out_proj"] == "rowwise"
    with pytest.raises(ValueError, match="the norms on its residual stream were not found"):
        plan_for(config, sequence_parallel=True, model=model)
    for model_type, why in [("bloom", "ALiBi biases"), ("trocr", "reshapes to its input's whole")]:
        config = coverage_config(model_type)
        with pytest.raises(ValueError, match=f"does not train what tp=1 trains: its .*{why}"):
            plan_for(config, model=meta_causal_lm(config))
    config = coverage_config("xglm")  # its layers beside the embeddings, its MLP its own linears
    model = meta_causal_lm(config)
    plan = plan_for(config, model=model)
    assert plan["model.layers.*.fc1"] == "colwise" and plan["model.layers.*.fc2"] == "rowwise"
    with pytest.raises(ValueError, match="'xglm' is not supported: its sinusoidal positions"):
        plan_for(config, sequence_parallel=True, model=model)


def test_a_pipeline_stages_sequence_parallel_norms_are_its_layers_by_their_names():
    """A stage keeps its layers under their indices in the whole model (``1``, not ``0``)."""
    from components.distributed.pipeline import keep_stage

    model = keep_stage(meta_causal_lm(tiny_config("llama")), [1], first=False, last=True)
    plan = plan_for(model.config, True, model)
    norms = sorted(name for name, style in plan.items() if style == "sequence_parallel")
    assert norms == [
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
