"""Experts and routers are found from a model's structure for every transformers MoE family, and
expert parallelism splits GPT-OSS's and Llama 4's, refusing by name the shapes it cannot (Llama
4's experts, called with tokens already routed, by the layout's rule on the facts found here)."""

import pytest
from transformers import (
    DeepseekV3Config,
    GptOssConfig,
    GraniteMoeConfig,
    JambaConfig,
    Llama4TextConfig,
    LongcatFlashConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3_5TextConfig,
)

from components.distributed.layout import ModelFacts, ParallelDims, Workload
from components.models import meta_causal_lm
from components.moe import check_expert_parallel
from components.moe.expert_parallel import routed_experts
from components.moe.structure import find_moe_modules
from recipes.tiny_models import tiny_config
from tests.coverage import tiny_config as coverage_config

WORK = Workload(global_batch_size=8, micro_batch_size=1, seq_len=16)

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    head_dim=16,
)
MLP = ("model.layers.*.mlp.experts",), ("model.layers.*.mlp.gate",)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (Qwen2MoeConfig(**SIZES, num_experts=4, moe_intermediate_size=32), MLP),
        (OlmoeConfig(**SIZES, num_experts=4), MLP),
        (DeepseekV3Config(**SIZES, n_routed_experts=4, first_k_dense_replace=1, n_group=1), MLP),
        (
            GraniteMoeConfig(**SIZES, num_local_experts=4),
            (
                ("model.layers.*.block_sparse_moe.experts",),
                ("model.layers.*.block_sparse_moe.router",),
            ),
        ),
        (
            GptOssConfig(**SIZES, num_local_experts=4),
            (("model.layers.*.mlp.experts",), ("model.layers.*.mlp.router",)),
        ),
        (tiny_config("mixtral"), MLP),
        (tiny_config("llama"), ((), ())),
        # a short convolution's 3-D kernel (Mamba, linear attention) is not experts
        (
            JambaConfig(**SIZES, num_experts=4, expert_layer_period=2, expert_layer_offset=1),
            (("model.layers.*.feed_forward.experts",), ("model.layers.*.feed_forward.router",)),
        ),
        (Qwen3_5TextConfig(**SIZES, layer_types=["linear_attention", "full_attention"]), ((), ())),
        # per-head 3-D parameters (Zamba's Mamba mixer: two heads) are not experts either
        (coverage_config("zamba"), ((), ())),
    ],
    ids=lambda value: getattr(value, "model_type", ""),
)
def test_experts_and_routers_are_found_from_the_structure(config, expected):
    assert find_moe_modules(meta_causal_lm(config)) == expected


def routed_problems(model, experts: list[str], ep: int, tp: int) -> list[str]:
    """The layout's rule on experts that take their tokens already routed, at ep and tp."""
    facts = ModelFacts(name="m", moe=True, layers=2, routed_experts=routed_experts(model, experts))
    dims = ParallelDims(dp_shard=4 // tp, tp=tp, ep=ep)  # 4 ranks
    return [problem.message for problem in dims.model_problems(WORK, facts)]


def test_gpt_oss_and_llama4_experts_split_and_where_llama4s_cannot_is_refused_by_name():
    gpt_oss = meta_causal_lm(GptOssConfig(**SIZES, num_local_experts=4))
    gpt_oss_experts = ["model.layers.*.mlp.experts"]
    assert check_expert_parallel(gpt_oss, gpt_oss_experts, 4, 2) == []
    assert routed_experts(gpt_oss, gpt_oss_experts) is None  # takes the routing: any tp
    llama4 = meta_causal_lm(Llama4TextConfig(**SIZES, num_local_experts=4))
    experts = ["model.layers.*.feed_forward.experts"]
    assert check_expert_parallel(llama4, experts, 4, 4) == []
    assert routed_problems(llama4, experts, ep=2, tp=2) == []  # folded
    assert routed_problems(llama4, experts, ep=2, tp=1) == []  # all-to-all
    assert routed_problems(llama4, experts, ep=4, tp=2) == [
        "model.layers.0.feed_forward.experts (and 1 more) (Llama4TextExperts) takes its tokens "
        "already routed: split only where ep divides tp or at tp=1, not at ep=4 tp=2"
    ]


def test_longcat_identity_experts_are_refused_by_name_at_ep2():
    config = LongcatFlashConfig(
        **{key: value for key, value in SIZES.items() if key != "num_hidden_layers"},
        num_layers=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_topk=2,
        n_routed_experts=4,
        zero_expert_num=2,
        expert_ffn_hidden_size=32,
        ffn_hidden_size=128,
    )
    model = meta_causal_lm(config)
    assert check_expert_parallel(model, ["model.layers.*.mlp.experts"], 4, 2) == [
        "model.layers.0.mlp.experts (LongcatFlashExperts) has 2 identity experts beside its 4 "
        "routed ones: expert parallelism of such experts is not supported yet; use ep=1"
    ]
