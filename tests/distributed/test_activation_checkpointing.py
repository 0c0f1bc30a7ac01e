"""Activation checkpointing recomputes exactly what it dropped: in fp32 on the CPU, ``full`` and
``selective`` give the loss and every gradient bitwise equal to ``none``, at tp=2 with and without
sequence parallelism, on an MoE model with expert parallelism, and under FSDP (dp=2 x tp=2); and the
recompute really happens.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.layout import resolve_parallel_dims
from components.distributed.tp_plan import apply_tp_plan
from components.models import build_causal_lm
from components.models.activation_checkpointing import apply_activation_checkpointing
from components.models.families import plan_for
from components.moe import apply_expert_parallel
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import mesh

BATCH, SEQ = 2, 16


def _parallel_model(config, world_size, tp, sequence_parallel, ep, mode):
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    model = build_causal_lm(config, seed=0)
    experts = ["model.layers.*.mlp.experts"] if ep > 1 else []
    plan = plan_for(config, sequence_parallel)
    apply_tp_plan(model, device_mesh["tp"], plan, config, sequence_parallel, tuple(experts))
    apply_expert_parallel(
        model, mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep")), device_mesh["tp"], experts
    )
    wrapped = apply_activation_checkpointing(model, mode)
    if dims.dp > 1:
        shard_data_parallel(model, device_mesh["dp"])
    return model, dims, device_mesh, wrapped


def _counting_recompute(model) -> list[int]:
    """Count forward calls of every block's attention: with checkpointing each runs twice per
    step."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(count)
    return calls


def check_same_as_none(rank, world_size, family, tp, sequence_parallel, ep, mode):
    config = tiny_config(family)
    tokens = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3)
    )
    labels = tokens.clone()
    labels[:, :4] = -100
    global_tokens = int((labels[:, 1:] != -100).sum())
    results = {}
    for name in ("none", mode):
        model, dims, device_mesh, wrapped = _parallel_model(
            config, world_size, tp, sequence_parallel, ep, name
        )
        calls = _counting_recompute(model)
        dp_rank = device_mesh["dp"].get_local_rank()
        loss = forward_backward(
            model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
        )
        finalize_dtensor_gradients([model])
        grads = {
            n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()
        }
        results[name] = (loss, grads, calls[0], wrapped)
    (loss_none, grads_none, calls_none, _), (loss_ac, grads_ac, calls_ac, wrapped) = (
        results["none"],
        results[mode],
    )
    differing = [n for n in grads_none if not torch.equal(grads_none[n], grads_ac[n])]
    return {
        "loss_equal": loss_none == loss_ac,
        "differing": differing,
        "grads": len(grads_none),
        "wrapped": wrapped,
        "calls": (calls_none, calls_ac),
        "layers": config.num_hidden_layers,
    }


def assert_bitwise(results):
    for result in results:
        assert result["loss_equal"]
        assert result["differing"] == [] and result["grads"] > 0
        assert result["wrapped"] == result["layers"]
        calls_none, calls_ac = result["calls"]
        assert calls_none == result["layers"]
        # the block's forward runs again in backward (selective replays its matmuls from what it
        # saved)
        assert calls_ac == 2 * result["layers"]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_tp2_checkpointing_is_bitwise_equal(ranks2, mode, sequence_parallel):
    assert_bitwise(ranks2.run(check_same_as_none, "llama", 2, sequence_parallel, 1, mode))


def test_moe_tp2_ep2_full_checkpointing_is_bitwise_equal(ranks2):
    assert_bitwise(ranks2.run(check_same_as_none, "qwen3_moe", 2, False, 2, "full"))


def test_dp2_tp2_full_checkpointing_is_bitwise_equal(ranks4):
    assert_bitwise(ranks4.run(check_same_as_none, "qwen3", 2, True, 1, "full"))


def test_unknown_mode_is_refused():
    with pytest.raises(
        ValueError, match="train.activation_checkpointing='some' is not one of none, full"
    ):
        apply_activation_checkpointing(build_causal_lm(tiny_config("llama"), seed=0), "some")


def test_wrapping_twice_is_refused():
    model = build_causal_lm(tiny_config("llama"), seed=0)
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="decoder block 0 already has its forward wrapped"):
        apply_activation_checkpointing(model, "full")
