"""Applying TP plans: checks before sharding, the coverage report, broadcast repair, memory per
rank, tied embeddings, a model's own HF plan, and loading a checkpoint slice by slice at tp > 1.

By default every check runs on 2 ranks; memory per rank and loading slice by slice at tp=4 run
with ``-m sweep``.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GemmaConfig

from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import broadcast_tp_replicas
from components.models import build_causal_lm, local_parameter_bytes
from components.models.families import plan_for
from recipes.tiny_models import tiny_config
from tests.distributed.test_tp_parity import assert_parity, parity
from tests.harness import mesh


def tp_mesh(world_size):
    return mesh((world_size,), ("tp",))


def check_kv_heads_do_not_divide(rank, world_size):
    config = tiny_config("llama", num_key_value_heads=1)
    model = build_causal_lm(config, seed=0)
    with pytest.raises(ValueError) as error:
        apply_tp_plan(model, tp_mesh(world_size), plan_for(config), config)
    return str(error.value), any(isinstance(p, DTensor) for p in model.parameters())


def test_kv_heads_that_do_not_divide_tp_fail_before_sharding(ranks2):
    for message, sharded in ranks2.run(check_kv_heads_do_not_divide):
        assert message == "tp (2) must divide num_key_value_heads (1)"
        assert not sharded


def check_coverage_report(rank, world_size, family, sequence_parallel):
    config = tiny_config(family)
    model = build_causal_lm(config, seed=0)
    report = apply_tp_plan(
        model, tp_mesh(world_size), plan_for(config, sequence_parallel), config, sequence_parallel
    )
    return report.sharded, report.replicated, report.format()


def test_coverage_report_names_every_replica_and_its_reduction(ranks2):
    sharded, replicated, text = ranks2.run(check_coverage_report, "qwen3", False)[0]
    assert replicated == {
        **{
            f"model.layers.{i}.self_attn.{n}.weight": "sum"
            for i in range(2)
            for n in ("q_norm", "k_norm")
        },
        **{
            f"model.layers.{i}.{n}.weight": "mean"
            for i in range(2)
            for n in ("input_layernorm", "post_attention_layernorm")
        },
        "model.norm.weight": "mean",
    }
    assert (
        sharded["lm_head.weight"] == "(Shard(dim=0),)"
        and sharded["model.embed_tokens.weight"] == "(Shard(dim=0),)"
    )
    assert len(sharded) + len(replicated) == 2 * 9 + 3 + 4  # every parameter is in exactly one list
    assert "replicated (sum): model.layers.*.self_attn.q_norm.weight ×2" in text


def check_broadcast_repairs_divergence(rank, world_size):
    config = tiny_config("llama")
    model = build_causal_lm(config, seed=0)
    if rank == 1:
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # an injected divergence on one rank only
    apply_tp_plan(model, tp_mesh(world_size), plan_for(config), config)
    before = model.model.norm.weight.detach().clone()
    broadcast_tp_replicas([model], tp_mesh(world_size))
    copies = [torch.empty_like(before) for _ in range(world_size)]
    dist.all_gather(copies, model.model.norm.weight.detach())
    return before.sum().item(), [copy.sum().item() for copy in copies]


def test_broadcast_repairs_an_injected_divergence(ranks2):
    (before_0, copies_0), (before_1, copies_1) = ranks2.run(check_broadcast_repairs_divergence)
    assert before_1 == before_0 + 64  # the divergence was there: 64 features, +1 each
    assert copies_0 == copies_1 == [before_0, before_0]


def check_parameter_bytes(rank, world_size):
    config = tiny_config("llama")
    model = build_causal_lm(config, seed=0)
    whole = local_parameter_bytes(model)
    apply_tp_plan(model, tp_mesh(world_size), plan_for(config), config)
    return whole, local_parameter_bytes(model)


@pytest.mark.parametrize("pool", ["ranks2", pytest.param("ranks4", marks=pytest.mark.sweep)])
def test_parameter_bytes_per_rank_shrink_with_tp(request, pool):
    for whole, local in request.getfixturevalue(pool).run(check_parameter_bytes):
        ratio = local / whole
        tp = 2 if pool == "ranks2" else 4
        print(f"tiny llama parameter bytes per rank: tp=1 {whole}, tp={tp} {local} ({ratio:.3f}x)")
        assert ratio <= 0.3 if tp == 4 else ratio <= 0.55


def check_parity_with_config(rank, world_size, config, tp, sequence_parallel, pretrained_path=None):
    return parity(world_size, config, tp, sequence_parallel, pretrained_path)


def tiny_gemma() -> GemmaConfig:
    # Gemma has no plan of ours: its own base_model_tp_plan is used; it also ties embeddings by
    # default.
    llama = tiny_config("llama")
    sizes = (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "num_attention_heads",
    )
    return GemmaConfig(**{k: getattr(llama, k) for k in sizes}, num_key_value_heads=4, head_dim=8)


def test_a_model_without_our_plan_uses_its_own_hf_plan(ranks2):
    config = tiny_gemma()
    assert config.model_type not in ("llama", "qwen3") and config.tie_word_embeddings
    assert plan_for(config)["model.layers.*.self_attn.q_proj"] == "colwise"
    assert_parity(ranks2.run(check_parity_with_config, config, 2, True))


def test_tied_embeddings_stay_tied_and_train_the_same(ranks2):
    assert_parity(
        ranks2.run(
            check_parity_with_config, tiny_config("llama", tie_word_embeddings=True), 2, False
        )
    )


@pytest.mark.parametrize(
    ("pool", "tp"), [("ranks2", 2), pytest.param("ranks4", 4, marks=pytest.mark.sweep)]
)
def test_checkpoint_loaded_slice_by_slice_on_meta_trains_the_same(request, tmp_path, pool, tp):
    config = tiny_config("qwen3")
    build_causal_lm(config, seed=5).save_pretrained(tmp_path)
    ranks = request.getfixturevalue(pool)
    assert_parity(ranks.run(check_parity_with_config, config, tp, True, str(tmp_path)))


def test_sequence_parallel_also_works_with_eager_attention(ranks2):
    # Eager attention builds an explicit causal mask from hidden_states.shape: it must see the
    # global length.
    config = tiny_config("llama", attn_implementation="eager")
    assert_parity(ranks2.run(check_parity_with_config, config, 2, True))


def test_a_vocabulary_tp_does_not_divide_stays_replicated_and_trains_the_same(ranks2):
    # The documented fallback: embedding and lm_head replicated (mean), everything else sharded.
    assert_parity(
        ranks2.run(check_parity_with_config, tiny_config("llama", vocab_size=257), 2, False)
    )
