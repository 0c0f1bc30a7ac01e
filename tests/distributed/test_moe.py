"""MoE: attention tensor-parallel, experts split by expert over the folded ep axis, routers
replicated.

Llama 4's experts, handed their rows already routed, likewise. The parallel model must train
exactly like one process (loss 1e-5 relative, gathered gradients and
weights after one SGD lr=1 step 1e-5, grad norm 1e-6 relative), expert gradients must never be
touched by the replica sync, and after AdamW steps the replicas stay bitwise equal while experts
differ.

Each matrix of layouts, families and precisions keeps in make test the case that composes the most
(both dispatch modes and both families stay covered); its further cases, the same code paths at
other sizes or on the other family, are opt-in with ``-m sweep``.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Llama4TextConfig

import components.moe.expert_compute as expert_compute
from components.checkpoint.dcp import checkpoint_path, load_checkpoint, save_checkpoint
from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import grad_norm
from components.distributed.layout import resolve_parallel_dims
from components.distributed.replicas.drift import replica_drift
from components.distributed.tp_plan import apply_tp_plan, check_plan
from components.distributed.tp_replicas import synchronize_tp_replica_gradients
from components.models import build_causal_lm, meta_causal_lm
from components.models.families import FAMILIES, plan_for
from components.moe import ExpertLoad, apply_expert_parallel, check_expert_parallel, dispatch_mode
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.distributed.test_tp_parity import assert_parity, finish, global_batch, parity
from tests.harness import mesh

EXPERTS, ROUTERS = FAMILIES["qwen3_moe"].experts, FAMILIES["qwen3_moe"].routers  # = mixtral's
SWEEP = pytest.mark.sweep  # a matrix's further cases: opt-in with -m sweep


def check_moe_parity(rank, world_size, family, tp, ep, sequence_parallel, mode=None):
    return parity(
        world_size, tiny_config(family), tp, sequence_parallel, ep=ep, experts=EXPERTS, mode=mode
    )


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=SWEEP)])
@pytest.mark.parametrize(("tp", "ep"), [(2, 2)])
def test_tp2_ep2_matches_one_process(ranks2, family, tp, ep):
    assert_parity(ranks2.run(check_moe_parity, family, tp, ep, False))


@pytest.mark.parametrize(
    ("family", "tp", "ep"),
    [
        ("mixtral", 4, 2),  # ep < tp: all-to-all inside the TP group
        pytest.param("mixtral", 4, 4, marks=SWEEP),
        pytest.param("qwen3_moe", 4, 2, marks=SWEEP),
        pytest.param("qwen3_moe", 4, 4, marks=SWEEP),
    ],
)
def test_tp4_matches_one_process(ranks4, family, tp, ep):
    assert_parity(ranks4.run(check_moe_parity, family, tp, ep, False))


def check_llama4_parity(rank, world_size, tp, ep):
    config = Llama4TextConfig(
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_local_experts=4,
        interleave_moe_layer_step=2,
    )
    experts = ("model.layers.*.feed_forward.experts",)
    return parity(world_size, config, tp, False, ep=ep, experts=experts)


# tp=1: all-to-all over dp ranks; tp=2 (-m sweep): folded
@pytest.mark.parametrize(("tp", "ep"), [(1, 2), pytest.param(2, 2, marks=SWEEP)])
def test_llama4_experts_handed_routed_rows_match_one_process(ranks2, tp, ep):
    # Llama 4's experts take every token once per expert, already scaled by the router.
    assert_parity(ranks2.run(check_llama4_parity, tp, ep))


def test_folding_at_ep_below_tp_matches_one_process(ranks4):
    # Not the automatic choice at ep < tp (the all-to-all path measured faster), but valid: tp / ep
    # identical copies of each expert per TP group, their gradients scaled by ep / tp before the sum
    # over ep_shard.
    assert_parity(ranks4.run(check_moe_parity, "qwen3_moe", 4, 2, False, "folded"))


def test_sequence_parallel_moe_matches_one_process(ranks4):
    assert_parity(ranks4.run(check_moe_parity, "qwen3_moe", 4, 2, True))


def check_experts_over_dp(rank, world_size, family, tp, ep):
    result = parity(world_size, tiny_config(family), tp, False, ep=ep, experts=EXPERTS)
    model_mode = dispatch_mode(tp, ep)
    return result | {
        "mode": model_mode,
        "expert_drift": expert_copy_drift(family, world_size, tp, ep),
    }


def expert_copy_drift(family, world_size, tp, ep) -> tuple[float, int]:
    """After two AdamW steps on different dp data: the largest difference between an expert's
    ep_shard copies, and how many expert tensors have copies."""
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    config = tiny_config(family)
    model = build_causal_lm(config, seed=0)
    if tp > 1:
        apply_tp_plan(
            model, device_mesh["tp"], plan_for(config), config, moe_modules=EXPERTS + ROUTERS
        )
    apply_expert_parallel(
        model, mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep")), device_mesh["tp"], list(EXPERTS)
    )
    shard_data_parallel(model, device_mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    dp_rank = device_mesh["dp"].get_local_rank()
    for _ in range(2):
        optimizer.zero_grad()
        forward_backward(
            model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
        )
        finish(model, device_mesh)
        optimizer.step()
    experts = {n: d for n, d in replica_drift([model], device_mesh).items() if ".experts." in n}
    return (max(experts.values(), default=0.0), len(experts))


# Experts over data-parallel ranks (the world is dp x tp = 4): dispatched by all-to-all where an ep
# group spans dp ranks, folded where it lies inside a TP group; FSDP over dp on everything but the
# experts.
@pytest.mark.parametrize(
    ("family", "tp", "ep", "mode"),
    [
        ("qwen3_moe", 1, 2, "all_to_all"),  # all-to-all, FSDP and ep_shard copies
        pytest.param("qwen3_moe", 2, 4, "all_to_all", marks=SWEEP),
        pytest.param("qwen3_moe", 1, 4, "all_to_all", marks=SWEEP),
        pytest.param("qwen3_moe", 2, 2, "folded", marks=SWEEP),
        pytest.param("mixtral", 2, 4, "all_to_all", marks=SWEEP),
    ],
)
def test_experts_over_data_parallel_ranks_match_one_process(ranks4, family, tp, ep, mode):
    for result in ranks4.run(check_experts_over_dp, family, tp, ep):
        assert result["mode"] == mode
        assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
        assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-6)
        assert result["grad_error"] < 1e-5 and result["weight_error"] < 1e-5
        assert result["drifted"] == []
        drift, compared = result["expert_drift"]
        assert drift == 0.0  # ep_shard copies of an expert stay bitwise equal
        assert compared == (
            4 if 4 // ep > 1 else 0
        )  # 2 layers x 2 fused tensors, when there are copies


def build_parallel_moe(world_size, tp, ep):
    config = tiny_config("qwen3_moe")
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    model = build_causal_lm(config, seed=0)
    apply_tp_plan(model, device_mesh["tp"], plan_for(config), config, moe_modules=EXPERTS + ROUTERS)
    apply_expert_parallel(
        model, mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep")), device_mesh["tp"], list(EXPERTS)
    )
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
        # Every non-expert parameter with a gradient is counted (embedding/lm_head/attention shards
        # are not replicas); the count names no expert tensor.
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
    plan = plan_for(config) | {
        "model.layers.*.mlp.experts": "colwise",
        "model.layers.*.mlp.gate": "rowwise",
    }
    _, errors = check_plan(meta_causal_lm(config), config, plan, 2, EXPERTS + ROUTERS)
    assert (
        "plan shards model.layers.0.mlp.experts with 'colwise', but it is an MoE expert or router"
        in errors[0]
    )
    assert sum("MoE expert or router" in error for error in errors) == 4


def test_expert_parallel_sizes_are_checked():
    model = meta_causal_lm(tiny_config("qwen3_moe"))
    assert check_expert_parallel(model, list(EXPERTS), num_experts=8, ep=2) == []
    assert (
        check_expert_parallel(model, list(EXPERTS), num_experts=8, ep=4) == []
    )  # ep over dp x tp ranks
    assert check_expert_parallel(model, list(EXPERTS), num_experts=6, ep=4) == [
        "ep (4) must divide the number of experts (6)"
    ]
    assert check_expert_parallel(model, ["model.layers.*.moe"], 8, 2) == [
        "model.experts pattern 'model.layers.*.moe' matches no module of Qwen3MoeForCausalLM"
    ]


def check_idle_experts(rank, world_size):
    # Zero routers give every token the same top-2 (experts 0 and 1), so ranks 1.. own only idle
    # experts: they must still join every collective, and their experts get zero (not missing)
    # gradients.
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


def moe_run(world_size, tp, ep, seed, shard_experts=False):
    """Qwen3-MoE at (tp, ep, dp = world / tp) with AdamW: model, optimizer, scheduler, mesh,
    dims."""
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    config = tiny_config("qwen3_moe")
    model = build_causal_lm(config, seed=seed)
    if tp > 1:
        apply_tp_plan(
            model, device_mesh["tp"], plan_for(config), config, moe_modules=EXPERTS + ROUTERS
        )
    moe_mesh = mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep"))
    tp_mesh, patterns = device_mesh["tp"], list(EXPERTS)
    apply_expert_parallel(model, moe_mesh, tp_mesh, patterns, shard_experts=shard_experts)
    if dims.dp > 1:
        shard_data_parallel(model, device_mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return (
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        device_mesh,
        dims,
    )


def moe_step(model, optimizer, scheduler, device_mesh, dims, seed) -> float:
    config = tiny_config("qwen3_moe")
    tokens, labels, global_tokens = global_batch(config.vocab_size, seed=seed)
    dp_rank = device_mesh["dp"].get_local_rank()
    optimizer.zero_grad()
    local = forward_backward(
        model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
    )
    loss = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(loss, group=device_mesh["dp"].get_group())
    finish(model, device_mesh)
    optimizer.step()
    scheduler.step()
    return loss.item() / global_tokens


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    state = {}
    for name, parameter in model.named_parameters():
        state[name] = full_tensor(parameter.detach())
        for key, value in optimizer.state[parameter].items():
            state[f"{name}.{key}"] = full_tensor(value)
    return state


def full_tensor(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def check_save_moe(rank, world_size, root):
    run = moe_run(world_size, tp=2, ep=4, seed=0)
    for seed in range(2):
        moe_step(*run, seed=seed)
    save_checkpoint(Path(root), 2, *run[:3])
    reference = {
        "state": full_state(*run[:2]),
        "continued": [moe_step(*run, seed=seed) for seed in (2, 3)],
    }
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")


def check_load_moe(rank, world_size, root):
    run = moe_run(world_size, tp=1, ep=2, seed=1)
    load_checkpoint(checkpoint_path(Path(root), 2), *run[:3])
    reference = torch.load(Path(root) / "reference.pt")
    state = full_state(*run[:2])
    differ = [
        name
        for name, value in reference["state"].items()
        if not torch.equal(state.get(name), value)
    ]
    return differ, [moe_step(*run, seed=seed) for seed in (2, 3)], reference["continued"]


def test_a_checkpoint_at_tp2_ep4_dp2_loads_exactly_at_tp1_ep2_dp2(ranks2, ranks4, tmp_path):
    ranks4.run(check_save_moe, str(tmp_path))
    for differ, continued, reference in ranks2.run(check_load_moe, str(tmp_path)):
        assert differ == []  # every weight and AdamW moment, experts included, bitwise
        assert continued == pytest.approx(reference, rel=1e-6)


def check_idle_experts_dispatched(rank, world_size):
    # Zero routers send every token to experts 0 and 1, both on rank 0: ranks 1-3 receive no rows,
    # yet they must join every exchange, forward and backward, and their experts get zero (not
    # missing) gradients.
    config = tiny_config("qwen3_moe")
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    reference = build_causal_lm(config, seed=0)
    model, optimizer, scheduler, device_mesh, dims = moe_run(world_size, tp=2, ep=4, seed=0)
    for built in (reference, model):
        for layer in built.model.layers:
            torch.nn.init.zeros_(layer.mlp.gate.weight)
    reference_loss = forward_backward(reference, tokens, labels, global_tokens) / global_tokens
    loss = moe_step(
        model, optimizer, scheduler, device_mesh, dims, seed=1
    )  # global_batch's default seed
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    return (
        loss,
        reference_loss,
        grad_norm([model]).item(),
        grad_norm([reference]).item(),
        experts.grad is not None,
    )


def test_ranks_that_receive_no_tokens_still_join_every_exchange(ranks4):
    for loss, reference_loss, norm, reference_norm, has_grad in ranks4.run(
        check_idle_experts_dispatched
    ):
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        assert norm == pytest.approx(reference_norm, rel=1e-6)
        assert has_grad


def grouped_against_loop(rank, world_size, tp, ep, precision):
    """One forward and backward of the same EP model with grouped GEMM experts and with the loop:
    the relative difference of the loss and the largest of every local expert gradient's."""
    config = tiny_config("qwen3_moe")
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    dp_rank = device_mesh["dp"].get_local_rank()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    compute = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    results, calls = {}, {True: 0, False: 0}
    grouped_run, fits = expert_compute.run_experts_grouped, expert_compute.grouped_mm_fits

    def counted(*args, **kwargs):
        calls[grouped] += 1
        return grouped_run(*args, **kwargs)

    expert_compute.run_experts_grouped = counted
    try:
        for grouped in (True, False):
            model = build_causal_lm(config, seed=0, dtype=dtype)
            if tp > 1:
                plan, moe_modules = plan_for(config), EXPERTS + ROUTERS
                apply_tp_plan(model, device_mesh["tp"], plan, config, moe_modules=moe_modules)
            moe_mesh = mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep"))
            tp_mesh = device_mesh["tp"]
            apply_expert_parallel(model, moe_mesh, tp_mesh, list(EXPERTS))
            # the loop run: as where grouped GEMM cannot run
            expert_compute.grouped_mm_fits = fits if grouped else lambda *args: False
            batch = (tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens)
            loss = forward_backward(model, *batch, compute=compute)
            named = model.named_parameters()
            experts = {n: p.grad.to_local().float() for n, p in named if ".experts." in n}
            results[grouped] = (loss, experts)
    finally:
        expert_compute.run_experts_grouped = grouped_run
        expert_compute.grouped_mm_fits = fits
    (loss, grads), (loop_loss, loop_grads) = results[True], results[False]
    errors = [((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in loop_grads.items()]
    return {
        "mode": model.model.layers[0].mlp.experts.layout.mode,
        "loss": abs(loss - loop_loss) / abs(loop_loss),
        "grads": max(errors),
        "count": len(errors),
        "calls": calls,
    }


FOLDED, ALL_TO_ALL = (2, 2, "folded"), (1, 2, "all_to_all")


# Both dispatch paths under each precision: grouped GEMM runs where the loop ran, and agrees. Each
# precision runs once in make test, on alternating paths.
@pytest.mark.parametrize(
    ("tp", "ep", "mode", "precision", "band"),
    [
        (*FOLDED, "fp32", 1e-6),
        (*ALL_TO_ALL, "bf16-mixed", 2e-2),
        (*FOLDED, "bf16", 2e-2),
        pytest.param(*ALL_TO_ALL, "fp32", 1e-6, marks=SWEEP),
        pytest.param(*FOLDED, "bf16-mixed", 2e-2, marks=SWEEP),
        pytest.param(*ALL_TO_ALL, "bf16", 2e-2, marks=SWEEP),
    ],
)
def test_grouped_experts_match_the_loop_on_both_paths(ranks2, tp, ep, mode, precision, band):
    for result in ranks2.run(grouped_against_loop, tp, ep, precision):
        assert result["mode"] == mode and result["count"] == 4  # 2 layers x 2 fused tensors
        assert result["loss"] <= band and result["grads"] <= band
        assert result["calls"] == {True: 2, False: 0}  # grouped GEMM ran in both layers


def sharded_against_replicated(rank, world_size, tp, ep):
    """Two AdamW steps with experts sharded over ep_shard and with them replicated: losses, grad
    norms, full expert gradients and weights, and the expert bytes this rank keeps (weights,
    gradients, AdamW moments)."""
    result = {}
    for shard in (True, False):
        model, optimizer, scheduler, device_mesh, dims = moe_run(world_size, tp, ep, 0, shard)
        run = (model, optimizer, scheduler, device_mesh, dims)
        losses = [moe_step(*run, seed=seed) for seed in (0, 1)]
        norm = grad_norm([model]).item()
        experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
        parameters = list(experts.values())
        local = [p.to_local() for p in parameters] + [p.grad.to_local() for p in parameters]
        local += [v.to_local() for p in parameters for v in optimizer.state[p].values() if v.dim()]
        result[shard] = {
            "losses": losses,
            "norm": norm,
            "grads": {n: full_tensor(p.grad) for n, p in experts.items()},
            "weights": {n: full_tensor(p.detach()) for n, p in experts.items()},
            "bytes": sum(t.numel() * t.element_size() for t in local),
            "placement": str(next(iter(experts.values())).placements[0]),
        }
    sharded, replicated = result[True], result[False]

    def largest(key):
        return max((sharded[key][n] - t).abs().max().item() for n, t in replicated[key].items())

    return {
        "losses": (sharded["losses"], replicated["losses"]),
        "norms": (sharded["norm"], replicated["norm"]),
        "grad_error": largest("grads"),
        "weight_error": largest("weights"),
        "bytes": (sharded["bytes"], replicated["bytes"]),
        "placements": (sharded["placement"], replicated["placement"]),
    }


# ep_shard = 2 on both paths: the folded one (tp = ep = 2, dp = 2) and the all-to-all one (tp = 1).
@pytest.mark.parametrize(("tp", "ep"), [(2, 2), pytest.param(1, 2, marks=SWEEP)])
def test_experts_sharded_over_ep_shard_train_like_replicated_at_half_the_bytes(ranks4, tp, ep):
    for result in ranks4.run(sharded_against_replicated, tp, ep):
        sharded, replicated = result["losses"]
        assert sharded == pytest.approx(replicated, rel=1e-6)
        assert result["norms"][0] == pytest.approx(result["norms"][1], rel=1e-6)
        assert result["grad_error"] < 1e-6 and result["weight_error"] < 1e-6
        assert result["placements"] == ("S(1)", "R")  # on ep_shard
        assert result["bytes"][0] * 2 == result["bytes"][1]  # weights, gradients, AdamW moments


def check_save_sharded_moe(rank, world_size, root):
    run = moe_run(world_size, tp=1, ep=2, seed=0, shard_experts=True)
    for seed in range(2):
        moe_step(*run, seed=seed)
    save_checkpoint(Path(root), 2, *run[:3])
    state = full_state(*run[:2])
    reference = {"state": state, "continued": [moe_step(*run, seed=seed) for seed in (2, 3)]}
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")


def test_a_checkpoint_with_sharded_experts_loads_exactly_replicated(ranks2, ranks4, tmp_path):
    ranks4.run(check_save_sharded_moe, str(tmp_path))  # tp=1 ep=2 dp=4: ep_shard = 2, sharded
    for differ, continued, reference in ranks2.run(check_load_moe, str(tmp_path)):  # ep_shard = 1
        assert differ == []
        assert continued == pytest.approx(reference, rel=1e-6)


def biased_routing_steps(rank, world_size, tp, ep):
    """Three AdamW steps with the routing bias on (rate 0.01): at (tp, ep) and in one process."""
    config = tiny_config("qwen3_moe")
    reference = build_causal_lm(config, seed=0)
    reference_load = ExpertLoad.watch(reference, config, list(EXPERTS), None, ROUTERS, 0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer, scheduler, device_mesh, dims = moe_run(world_size, tp, ep, seed=0)
    dp_group = device_mesh["dp"].get_group()
    load = ExpertLoad.watch(model, config, list(EXPERTS), dp_group, ROUTERS, 0.01)
    losses, reference_losses = [], []
    for seed in range(3):
        losses.append(moe_step(model, optimizer, scheduler, device_mesh, dims, seed=seed))
        load.end_step()  # the step's counts move the bias
        tokens, labels, global_tokens = global_batch(config.vocab_size, seed=seed)
        reference_optimizer.zero_grad()
        loss_sum = forward_backward(reference, tokens, labels, global_tokens)
        reference_losses.append(loss_sum / global_tokens)
        reference_optimizer.step()
        reference_load.end_step()
    bias = [layer.mlp.gate.routing_bias for layer in model.model.layers]
    reference_bias = [layer.mlp.gate.routing_bias for layer in reference.model.layers]
    same = all(map(torch.equal, bias, reference_bias))
    return losses, reference_losses, same, bias[0].abs().sum()


# dp = 2 at tp = 1: the bias follows counts summed over dp ranks
@pytest.mark.parametrize(("tp", "ep"), [(1, 2), pytest.param(2, 2, marks=SWEEP)])
def test_the_routing_bias_trains_like_one_process(ranks2, tp, ep):
    for losses, reference_losses, same_bias, moved in ranks2.run(biased_routing_steps, tp, ep):
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert same_bias and moved > 0
