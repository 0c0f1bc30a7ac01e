"""MoE: attention tensor-parallel, experts split by expert over the folded ep axis, routers replicated.

The parallel model must train exactly like one process (loss 1e-5 relative, gathered gradients and
weights after one SGD lr=1 step 1e-5, grad norm 1e-6 relative), expert gradients must never be touched
by the replica sync, and after AdamW steps the replicas stay bitwise equal while experts differ.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.distributed.grads import grad_norm
from components.distributed.mesh import resolve_parallel_dims
from components.distributed.tp_plan import apply_tp_plan, check_plan, plan_for
from components.distributed.tp_replicas import synchronize_tp_replica_gradients
from components.models import build_causal_lm, meta_causal_lm, tiny_config
from components.moe import apply_expert_parallel, check_expert_parallel
from components.training.step import forward_backward
from tests.distributed.test_tp_parity import assert_parity, finish, global_batch, parity
from tests.harness import mesh

EXPERTS = ("model.layers.*.mlp.experts",)
ROUTERS = ("model.layers.*.mlp.gate",)


def check_moe_parity(rank, world_size, family, tp, ep, sequence_parallel):
    return parity(world_size, tiny_config(family), tp, sequence_parallel, ep=ep, experts=EXPERTS)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(("tp", "ep"), [(2, 2)])
def test_tp2_ep2_matches_one_process(ranks2, family, tp, ep):
    assert_parity(ranks2.run(check_moe_parity, family, tp, ep, False))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(("tp", "ep"), [(4, 4), (4, 2)])
def test_tp4_matches_one_process(ranks4, family, tp, ep):
    assert_parity(ranks4.run(check_moe_parity, family, tp, ep, False))


def test_sequence_parallel_moe_matches_one_process(ranks4):
    assert_parity(ranks4.run(check_moe_parity, "qwen3_moe", 4, 2, True))


def build_parallel_moe(world_size, tp, ep):
    config = tiny_config("qwen3_moe")
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    model = build_causal_lm(config, seed=0)
    apply_tp_plan(model, device_mesh["tp"], plan_for(config), config, moe_modules=EXPERTS + ROUTERS)
    apply_expert_parallel(model, mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep")), list(EXPERTS))
    return model, device_mesh


def check_experts_untouched_by_sync(rank, world_size):
    model, device_mesh = build_parallel_moe(world_size, tp=world_size, ep=world_size)
    tokens, labels, global_tokens = global_batch(256)
    forward_backward(model, tokens, labels, global_tokens)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    for parameter in experts:
        parameter.grad.to_local().fill_(2.0**rank)
    router = model.model.layers[0].mlp.gate.weight
    router.grad.fill_(2.0**rank)
    synced = synchronize_tp_replica_gradients([model], device_mesh)
    expected_count = sum(1 for n, _ in model.named_parameters() if ".experts." not in n)
    return {
        "experts_untouched": all(bool((p.grad.to_local() == 2.0**rank).all()) for p in experts),
        "router": router.grad[0, 0].item(),
        "synced": synced,
        "expected_count": expected_count,
        "expert_count": len(experts),
    }


def test_expert_gradients_are_excluded_and_the_router_is_reduced(ranks4):
    for result in ranks4.run(check_experts_untouched_by_sync):
        assert result["experts_untouched"] and result["expert_count"] == 4
        assert result["router"] == (1 + 2 + 4 + 8) / 4  # mean over the 4 TP ranks
        # Every non-expert parameter with a gradient is counted (embedding/lm_head/attention shards are
        # not replicas); the count names no expert tensor.
        assert result["synced"] < result["expected_count"]


def check_sync_count_excludes_experts(rank, world_size):
    model, device_mesh = build_parallel_moe(world_size, tp=world_size, ep=world_size)
    tokens, labels, global_tokens = global_batch(256)
    forward_backward(model, tokens, labels, global_tokens)
    synced = synchronize_tp_replica_gradients([model], device_mesh)
    replicas = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    return synced, replicas


def test_sync_count_is_exactly_the_plain_replicas(ranks2):
    for synced, replicas in ranks2.run(check_sync_count_excludes_experts):
        assert not any(".experts." in name for name in replicas)
        assert synced == len(replicas)  # norms, q/k norms and routers; no expert tensor


def check_experts_differ_after_training(rank, world_size):
    model, device_mesh = build_parallel_moe(world_size, tp=world_size, ep=world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels, global_tokens = global_batch(256)
    for _ in range(2):
        optimizer.zero_grad()
        forward_backward(model, tokens, labels, global_tokens)
        synchronize_tp_replica_gradients([model], device_mesh)
        optimizer.step()
    local = model.model.layers[0].mlp.experts.gate_up_proj.to_local().detach().contiguous()
    copies = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(copies, local)
    return all(not torch.equal(copies[i], copies[j]) for i in range(world_size) for j in range(i))


def test_local_experts_are_different_experts(ranks2):
    assert ranks2.run(check_experts_differ_after_training) == [True, True]


def test_dense_styles_on_experts_or_routers_are_refused():
    config = tiny_config("qwen3_moe")
    plan = plan_for(config) | {"model.layers.*.mlp.experts": "colwise", "model.layers.*.mlp.gate": "rowwise"}
    _, errors = check_plan(meta_causal_lm(config), config, plan, 2, EXPERTS + ROUTERS)
    assert "plan shards model.layers.0.mlp.experts with 'colwise', but it is an MoE expert or router" in errors[0]
    assert sum("MoE expert or router" in error for error in errors) == 4


def test_expert_parallel_sizes_are_checked():
    model = meta_causal_lm(tiny_config("qwen3_moe"))
    assert check_expert_parallel(model, list(EXPERTS), num_experts=8, ep=2, tp=4) == []
    assert check_expert_parallel(model, list(EXPERTS), num_experts=8, ep=4, tp=2) == [
        "ep (4) must divide tp (2): experts are split across ranks that share the same tokens"
    ]
    assert check_expert_parallel(model, list(EXPERTS), num_experts=6, ep=4, tp=4) == [
        "ep (4) must divide the number of experts (6)"
    ]
    assert check_expert_parallel(model, ["model.layers.*.moe"], 8, 2, 2) == [
        "model.experts pattern 'model.layers.*.moe' matches no module of Qwen3MoeForCausalLM"
    ]


def check_idle_experts(rank, world_size):
    # Zero routers give every token the same top-2 (experts 0 and 1), so ranks 1.. own only idle experts:
    # they must still join every collective, and their experts get zero (not missing) gradients.
    config = tiny_config("qwen3_moe")
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    reference = build_causal_lm(config, seed=0)
    model, device_mesh = build_parallel_moe(world_size, tp=world_size, ep=world_size)
    for built in (reference, model):
        for layer in built.model.layers:
            torch.nn.init.zeros_(layer.mlp.gate.weight)
    reference_loss = forward_backward(reference, tokens, labels, global_tokens)
    loss = forward_backward(model, tokens, labels, global_tokens)
    norm = finish(model, device_mesh)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    return loss, reference_loss, norm, grad_norm([reference]).item(), experts.grad is not None


def test_ranks_whose_experts_get_no_tokens_still_train_in_step(ranks4):
    for loss, reference_loss, norm, reference_norm, has_grad in ranks4.run(check_idle_experts):
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        assert norm == pytest.approx(reference_norm, rel=1e-6)
        assert has_grad
