"""The one table of model families: per Hugging Face ``model_type``, all the project knows of it.

A family names its config class (imported only when asked for: reading the table imports nothing
heavy), its tensor-parallel plan (module patterns to style names, applied by
``components.distributed.tp_plan``) and its MoE expert and router modules (none for a dense model).
How checkpoints store each expert is transformers' own conversion rules' (``models.checkpoint``).
``conf/model/*.yaml`` names a family and leaves ``experts``/``routers`` null to take them from here.
"""

import fnmatch
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _plan(*parts: Mapping[str, str]) -> Mapping[str, str]:
    """One read-only plan from ``parts`` (later parts win)."""
    merged: dict[str, str] = {}
    for part in parts:
        merged |= part
    return MappingProxyType(merged)


_DENSE_DECODER = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn": "attention_input",
    "model.layers.*.mlp": "mlp_input",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_parallel",
}
_QK_NORMS = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
# MoE blocks are left to expert parallelism (components.moe); attention and the vocabulary are TP.
_MOE_DECODER = {name: style for name, style in _DENSE_DECODER.items() if ".mlp" not in name}

# Added under sequence parallelism: norms run on sequence shards (any plan, a model's own too) ...
SEQUENCE_PARALLEL_NORMS = _plan(
    {
        "model.layers.*.input_layernorm": "sequence_parallel",
        "model.layers.*.post_attention_layernorm": "sequence_parallel",
        "model.norm": "sequence_parallel",
    }
)
# ... and an MoE block gathers the sequence once and hands back sequence shards.
_SEQUENCE_PARALLEL_MOE = _plan(SEQUENCE_PARALLEL_NORMS, {"model.layers.*.mlp": "gather_sequence"})

# transformers 5 MoE blocks: fused 3-D experts split by expert parallelism, a replicated router.
_FUSED_EXPERTS = ("model.layers.*.mlp.experts",)
_ROUTERS = ("model.layers.*.mlp.gate",)


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family; :data:`FAMILIES` holds one per ``model_type``."""

    config_name: str  # the transformers config class, e.g. "LlamaConfig" (see config_class)
    plan: Mapping[str, str]  # the TP plan: module pattern (``*``: a layer index) -> style name
    # Added to the plan under sequence parallelism.
    sequence_parallel_plan: Mapping[str, str] = field(
        default_factory=lambda: SEQUENCE_PARALLEL_NORMS,
    )
    experts: tuple[str, ...] = ()  # MoE expert modules (patterns), split across ep ranks
    routers: tuple[str, ...] = ()  # MoE routers (patterns): replicated, never sharded by the plan

    @property
    def moe(self) -> bool:
        return bool(self.experts)

    def config_class(self) -> type["PretrainedConfig"]:
        """The config class, imported from transformers on first use."""
        return getattr(importlib.import_module("transformers"), self.config_name)


FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "llama": Family(config_name="LlamaConfig", plan=_plan(_DENSE_DECODER)),
        "mistral": Family(config_name="MistralConfig", plan=_plan(_DENSE_DECODER)),
        "qwen2": Family(config_name="Qwen2Config", plan=_plan(_DENSE_DECODER)),
        "qwen3": Family(config_name="Qwen3Config", plan=_plan(_DENSE_DECODER, _QK_NORMS)),
        "qwen3_moe": Family(
            config_name="Qwen3MoeConfig",
            plan=_plan(_MOE_DECODER, _QK_NORMS),
            sequence_parallel_plan=_SEQUENCE_PARALLEL_MOE,
            experts=_FUSED_EXPERTS,
            routers=_ROUTERS,
        ),
        "mixtral": Family(
            config_name="MixtralConfig",
            plan=_plan(_MOE_DECODER),
            sequence_parallel_plan=_SEQUENCE_PARALLEL_MOE,
            experts=_FUSED_EXPERTS,
            routers=_ROUTERS,
        ),
    }
)


def moe_patterns(
    config: "PretrainedConfig", experts: Sequence[str] | None, routers: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expert patterns, router patterns) of a model: each as given, or (None) its family's from
    the table, else found from the structure of a meta-device build of ``config``
    (``components.moe.structure``); none for a dense model."""
    if experts is None or routers is None:
        family = FAMILIES.get(config.model_type)
        found = (family.experts, family.routers) if family else _structure(config)
    return (
        tuple(found[0] if experts is None else experts),
        tuple(found[1] if routers is None else routers),
    )


_FOUND: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _structure(config: "PretrainedConfig") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The experts and routers a model of ``config`` has (built on the meta device once per
    config)."""
    from components.models.build import meta_causal_lm
    from components.moe.structure import find_moe_modules

    key = config.to_json_string()
    if key not in _FOUND:
        _FOUND[key] = find_moe_modules(meta_causal_lm(config))
    return _FOUND[key]


def plan_for(config, sequence_parallel: bool = False, model=None) -> dict[str, str]:
    """The plan for a Hugging Face config: its family's, else the model's own TP plan
    (``base_model_tp_plan``), else (given the ``model``, a meta-device build is enough) one derived
    from its structure (``components.models.derived_plan``), in the style names of
    ``components.distributed.tp_plan``. Under sequence parallelism, given the ``model``, every
    norm on its residual stream is found from the structure (``sequence_parallel_norms``), and
    outside the table every MoE block and every sublayer the plan leaves replicated gathers the
    sequence; without it,
    :data:`SEQUENCE_PARALLEL_NORMS` names the norms.

    Raises:
        ValueError: for a model with no plan, none given or derivable (the modules it cannot
            place named).
    """
    family = FAMILIES.get(config.model_type)
    if family is not None:
        plan = dict(family.plan)
    elif getattr(config, "base_model_tp_plan", None):
        plan = _own_plan(config, model)
    elif model is not None:
        from components.models.derived_plan import derive_plan

        plan = derive_plan(model, config)
    else:
        raise ValueError(
            f"no tensor-parallel plan for model type {config.model_type!r}: "
            f"known {sorted(FAMILIES)}, and its config has no base_model_tp_plan"
        )
    if sequence_parallel:
        plan |= family.sequence_parallel_plan if family is not None else SEQUENCE_PARALLEL_NORMS
    if sequence_parallel and model is not None:  # the norms the structure has, not those names
        from components.models.derived_plan import sequence_parallel_norms

        norms = sequence_parallel_norms(model)
        plan = {k: v for k, v in plan.items() if v != "sequence_parallel" or not norms} | norms
        if family is None:  # MoE blocks and unplanned sublayers run on whole tokens, by name
            plan = _sequence_parallel_outside_table(config, model, plan, bool(norms))
    return plan


def _sequence_parallel_outside_table(config, model, plan: dict[str, str], found: bool):
    """``plan`` with every MoE block and unplanned sublayer gathering the sequence.

    Raises:
        ValueError: where the norms were ``found`` neither from the structure nor by their usual
            names, or modules beside the decoder layers would meet sequence shards.
    """
    from components.models.derived_plan import (
        NOT_SEQUENCE_PARALLEL,
        beside_layers,
        unplanned_sublayers,
    )

    if why := NOT_SEQUENCE_PARALLEL.get(config.model_type):
        raise ValueError(
            f"sequence parallelism with model type {config.model_type!r} is not supported: {why}; "
            "use sp=false"
        )
    names = [name for name, _ in model.named_modules()]
    named = [p for p, s in plan.items() if s == "sequence_parallel" and fnmatch.filter(names, p)]
    if not found and not named:
        raise ValueError(
            f"sequence parallelism with model type {config.model_type!r}: the norms on its "
            "residual stream were not found (its decoder layers are not one nn.ModuleList beside "
            "its embeddings); use sp=false"
        )
    if beside := beside_layers(model, plan):
        raise ValueError(
            f"sequence parallelism with {', '.join(beside)} (modules beside the decoder layers "
            "that the plan does not split, which would meet sequence shards) is not supported; "
            "use sp=false"
        )
    gathered = [*moe_blocks(config, model), *unplanned_sublayers(model, plan)]
    return plan | dict.fromkeys(gathered, "gather_sequence")


def moe_blocks(config, model) -> list[str]:
    """The names of the modules that hold the experts (the MoE blocks, which route whole tokens)."""
    from components.moe.expert_parallel import expert_modules

    experts, _ = moe_patterns(config, None, None)
    return sorted({name.rpartition(".")[0] for name in expert_modules(model, list(experts))})


def _own_plan(config, model=None) -> dict[str, str]:
    """The model's own plan (``base_model_tp_plan``) in our names, less its entries for the MoE
    experts (split by expert parallelism, as in every family of the table) and, given the
    ``model``, less its :func:`unbuilt_patterns`; the embedding and head as in every plan."""
    base = _base_model_name(model)
    plan = {
        f"{base}.{pattern}": style
        for pattern, style in config.base_model_tp_plan.items()
        if not _in_experts(config, f"{base}.{pattern}")
    }
    unbuilt = unbuilt_patterns(config, model) if model is not None else []
    plan = {pattern: style for pattern, style in plan.items() if pattern not in unbuilt}
    plan = _corrected(config, plan)
    return plan | _vocabulary_plan(model)


# Where a model's own plan computes something else than the model at tp=1, its corrections.
_OWN_PLAN_CORRECTIONS = {
    # Doge's dt_proj mixes all KV heads' values into one value per KV head, scaled by ``A`` (one
    # per KV head): summed rowwise, each rank keeps its heads' (its attention's mask), A sharded.
    "doge": {
        "model.layers.*.self_attn.dt_proj": "rowwise_local_heads",
        "model.layers.*.self_attn.A": "colwise",
    },
}


def _corrected(config, plan: dict[str, str]) -> dict[str, str]:
    """The model's own plan with :data:`_OWN_PLAN_CORRECTIONS`, and Gemma 3n's MLPs with
    activation sparsity left whole: they cut the gate at its mean plus a multiple of its standard
    deviation over the intermediate size, which ``colwise`` splits (every other layer's MLP is
    split as the plan says)."""
    plan = plan | _OWN_PLAN_CORRECTIONS.get(config.model_type, {})
    sparsity = getattr(config, "activation_sparsity_pattern", None) or []
    if not any(value > 0 for value in sparsity):
        return plan
    mlp = {p: style for p, style in plan.items() if p.startswith("model.layers.*.mlp.")}
    dense = [index for index, value in enumerate(sparsity) if not value > 0]
    split = {p.replace("*", str(index), 1): s for p, s in mlp.items() for index in dense}
    return {p: style for p, style in plan.items() if p not in mlp} | split


def _base_model_name(model) -> str:
    """Where the base model sits in the causal LM, which its ``base_model_tp_plan`` is relative to:
    ``model`` in most, ``gpt_neox`` or ``backbone`` in some (its ``base_model_prefix``)."""
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    return prefix if hasattr(inner, "named_modules") else "model"  # a submodule, not a string


def _vocabulary_plan(model) -> dict[str, str]:
    """The embedding (rows) and the head (vocab-parallel), by the names the model gives them. An
    embedding that holds modules of its own (Inkling's norm after the lookup) stays replicated: a
    split lookup's partial rows would pass its norm before they are summed."""
    if model is None:
        return {"model.embed_tokens": "embedding_rowwise", "lm_head": "vocab_parallel"}
    names = {id(module): name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    inner = embedding is not None and any(True for _ in embedding.children())
    style = "replicate" if inner else "embedding_rowwise"
    plan = {names[id(embedding)]: style} if id(embedding) in names else {}
    return plan | ({names[id(head)]: "vocab_parallel"} if id(head) in names else {})


def unbuilt_patterns(config, model) -> list[str]:
    """The patterns of the model's own plan (``base_model_tp_plan``, experts aside) that match no
    module of ``model`` (a meta-device build is enough): written for layer kinds its config does
    not build, such as Qwen2-MoE's dense MLP when every layer is sparse. Left out, with a note."""
    if config.model_type in FAMILIES or not getattr(config, "base_model_tp_plan", None):
        return []
    names = [name for name, _ in model.named_modules() if name]
    names += [name for name, _ in model.named_parameters()]  # a pattern may name parameters
    patterns = [f"{_base_model_name(model)}.{pattern}" for pattern in config.base_model_tp_plan]
    return [p for p in patterns if not _in_experts(config, p) and not fnmatch.filter(names, p)]


def expert_entries(config, model=None) -> list[str]:
    """The entries of the model's own plan for its experts (HF's tensor parallelism inside each
    expert: ``moe_tp_experts``, ``packed_colwise``...), which :func:`plan_for` leaves out: expert
    parallelism splits the experts instead, whole experts per rank. Named relative to ``model``'s
    base model, as :func:`plan_for` reads them (``model`` when not given)."""
    if config.model_type in FAMILIES:
        return []
    own, base = getattr(config, "base_model_tp_plan", None) or {}, _base_model_name(model)
    return [f"{p} {s}" for p, s in own.items() if _in_experts(config, f"{base}.{p}")]


def _in_experts(config, pattern: str) -> bool:
    """Whether a plan pattern names an experts module of the model, or something inside one."""
    experts, _ = moe_patterns(config, None, None)
    return any(pattern == e or pattern.startswith(f"{e}.") for e in experts)


def plan_is_derived(config) -> bool:
    """Whether :func:`plan_for` derives this model's plan from its structure (no family, no
    ``base_model_tp_plan``)."""
    return config.model_type not in FAMILIES and not getattr(config, "base_model_tp_plan", None)


def _language_adapters(config, where) -> list[str]:
    """X-MOD picks its language adapters by language ids, which the recipe does not pass, else
    by its config's ``default_language``: that must be one of its languages."""
    languages = list(getattr(config, "languages", None) or [])
    default = getattr(config, "default_language", None)
    if not languages or not hasattr(config, "default_language") or default in languages:
        return []
    return [
        f"model type '{config.model_type}' picks its language adapters by language ids, which the "
        "recipe does not pass (not supported), else by its config's default_language: "
        f"{where} sets {default!r}, not one of its languages: set default_language to one of "
        f"{', '.join(languages)}"
    ]


# What a model type's config must say for the recipe to run it, beyond every model's checks
# (``components/models/checks.py``): model_type -> its errors, given the config and where it is.
CONFIG_RULES = MappingProxyType({"xmod": _language_adapters})


def config_rule_errors(config: "PretrainedConfig", where) -> list[str]:
    """The errors of ``config`` by its model type's rule in :data:`CONFIG_RULES` (none without)."""
    rule = CONFIG_RULES.get(config.model_type)
    return rule(config, where) if rule is not None else []
