"""``peft.experts``'s checks, before any rank starts: what per-expert adapters cannot do is one
problem each, naming what would work; and what a checkpoint records of the peft settings."""

from components.models import meta_causal_lm
from components.models.checks import LoraTargets, lora_problems
from components.models.families import FAMILIES
from components.models.lora import PROJECTIONS, LoRAExperts
from recipes.compose import compose
from recipes.outputs import peft_info
from recipes.tiny_models import tiny_config
from recipes.validate import validate

EXPERTS = FAMILIES["qwen3_moe"].experts


def peft(*overrides: str):
    return validate(compose(["peft=lora", "peft.experts=true", *overrides])).peft


def targets() -> LoraTargets:
    """``peft=lora peft.experts=true``'s targets, as the checks read them."""
    given = peft()
    return LoraTargets(target_modules=given.target_modules, experts=given.experts)


def messages(found) -> list[str]:
    return [f"{problem.key}: {problem.message}" for problem in found]


def test_expert_adapters_convert_the_experts_in_place():
    meta = meta_causal_lm(tiny_config("qwen3_moe"))
    assert lora_problems(meta, targets(), EXPERTS, "qwen3_moe") == []
    assert isinstance(meta.model.layers[1].mlp.experts, LoRAExperts)


def test_dropout_with_expert_adapters_is_refused_as_peft_would_refuse_the_export():
    (error,) = peft("peft.dropout=0.1").errors()
    assert error.startswith("peft.dropout=0.1 with peft.experts=true is not supported: ")
    assert error.endswith("use peft.dropout=0.0 or peft.experts=false")


def test_a_dense_model_or_experts_of_another_form_are_refused():
    dense = meta_causal_lm(tiny_config("llama"))
    assert messages(lora_problems(dense, targets(), (), "llama")) == [
        "peft.experts: peft.experts=true needs an MoE model: model=llama has no experts "
        "(model.experts names none); use peft.experts=false"
    ]
    meta = meta_causal_lm(tiny_config("qwen3_moe"))
    for layer in meta.model.layers:
        layer.mlp.experts.has_bias = True  # as GPT-OSS's experts
    assert messages(lora_problems(meta, targets(), EXPERTS, "qwen3_moe")) == [
        "peft.experts: peft.experts=true: model.layers.0.mlp.experts (and 1 more) "
        "(Qwen3MoeExperts) has biases: LoRA on such experts is not supported: use "
        "peft.experts=false"
    ]


def test_null_targets_are_checkpointed_as_the_patterns_they_stand_for():
    """A run with the default ``peft.target_modules=null`` resumes a checkpoint whose run listed
    the projections (the default before null), and records a list given as given."""
    listed = validate(compose(["peft=lora", f"peft.target_modules=[{','.join(PROJECTIONS)}]"]))
    default = validate(compose(["peft=lora"]))
    assert default.peft.target_modules is None
    assert peft_info(default.peft) == peft_info(listed.peft) == listed.peft.model_dump()
    given = validate(compose(["peft=lora", "peft.target_modules=[lm_head]"])).peft
    assert peft_info(given)["target_modules"] == ["lm_head"]
