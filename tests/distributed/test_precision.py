"""Precision policies on real gloo ranks: bf16-mixed moves TP activations in bf16 and stays within
bf16 rounding of fp32; bf16 sends its bf16 gradients through the FP32 reduction paths of gradient
finalisation and the TP replica sync, end to end; FSDP's mixed-precision policy keeps fp32 shards
and fp32 gradients.

Bands, from measured differences (tiny models, one step, this machine): a bf16 matmul input is
rounded to 8 significant bits (2**-9 = 2e-3 relative each), but the summed token loss averages those
errors: measured 1.3e-5 relative (bf16-mixed tp=2 vs fp32 tp=1), 4.4e-5 (bf16 tp=2 vs bf16 tp=1),
2.9e-5 (FSDP bf16-mixed dp=2 x tp=2 vs fp32); band 1e-3. A single gradient element carries a few
bf16 ulps of its tensor's scale: measured 8.7e-3 (bf16) and 6.4e-3 (FSDP bf16-mixed) of the largest
gradient, band 3e-2. The grad norm, an average again: measured 4e-5 relative, band 1e-3.
"""

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import finalize_dtensor_gradients, grad_norm
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm
from components.models.families import plan_for
from components.models.precision import precision_policy
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.distributed.common import recorded_collectives
from tests.harness import mesh

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
LABELS = TOKENS.clone()
LABELS[:, :3] = -100
GLOBAL_TOKENS = int((LABELS[:, 1:] != -100).sum())
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _FunctionalCollectives(TorchDispatchMode):
    """Counts (collective, dtype) of the functional collectives DTensor issues (TP activations)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            self.calls[(name, str(args[0].dtype))] += 1
        return func(*args, **(kwargs or {}))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _tp_model(config, tp_mesh, sequence_parallel, dtype=torch.float32):
    model = build_causal_lm(config, seed=0, dtype=dtype)
    apply_tp_plan(model, tp_mesh, plan_for(config, sequence_parallel), config, sequence_parallel)
    return model


def check_bf16_mixed_tp_collectives(rank, world_size, sequence_parallel):
    config, policy = tiny_config("llama"), precision_policy("bf16-mixed")
    tp_mesh = mesh((world_size,), ("tp",))
    results = {}
    for cast in (False, True):
        model = _tp_model(config, tp_mesh, sequence_parallel)
        cast_modules = policy.cast_tp_inputs(model, fsdp=False) if cast else 0
        with _FunctionalCollectives() as recorder, policy.autocast("cpu", fsdp=False):
            loss = forward_backward(model, TOKENS, LABELS, GLOBAL_TOKENS)
        results[cast] = (loss, dict(recorder.calls), cast_modules)
    fp32_loss = forward_backward(build_causal_lm(config, seed=0), TOKENS, LABELS, GLOBAL_TOKENS)
    return {"results": results, "fp32_loss": fp32_loss, "layers": config.num_hidden_layers}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_bf16_mixed_tp_activation_collectives_run_in_bf16(ranks2, sequence_parallel):
    for result in ranks2.run(check_bf16_mixed_tp_collectives, sequence_parallel):
        (loss_autocast, calls_autocast, _), (loss_cast, calls_cast, cast_modules) = (
            result["results"][False],
            result["results"][True],
        )
        assert (
            cast_modules == 2 * result["layers"] + 1
        )  # attention and MLP of each block, and lm_head
        # Autocast alone: the blocks' outputs move in bf16, their fp32 norm outputs do not.
        assert sum(n for (_, dtype), n in calls_autocast.items() if dtype == "torch.bfloat16") > 0
        # With the cast, every TP activation collective is bf16 but the residual stream's: the
        # embedding's output (all-reduced, or reduce-scattered under SP, whose backward all-gathers
        # its fp32 gradient), and the loss is bitwise what autocast alone gives.
        fp32 = {key[0]: n for key, n in calls_cast.items() if key[1] == "torch.float32"}
        assert fp32 == (
            {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}
            if sequence_parallel
            else {"all_reduce": 1}
        )
        assert sum(calls_cast.values()) == sum(calls_autocast.values())
        assert loss_cast == loss_autocast
        # The key is honoured (bf16 compute differs from fp32) by no more than bf16 rounding.
        assert loss_cast != result["fp32_loss"]
        assert loss_cast == pytest.approx(result["fp32_loss"], rel=1e-3)


def check_bf16_end_to_end(rank, world_size):
    """qwen3 (q/k norms: 'sum' replica sync) with SP (norms get Partial grads): all in bf16 at
    tp=2."""
    config, policy = tiny_config("qwen3"), precision_policy("bf16")
    device_mesh = mesh((1, world_size), ("dp", "tp"))
    reference = build_causal_lm(config, seed=0, dtype=policy.param_dtype)
    reference_loss = forward_backward(reference, TOKENS, LABELS, GLOBAL_TOKENS)
    model = _tp_model(config, device_mesh["tp"], True, policy.param_dtype)
    broadcast_tp_replicas([model], device_mesh)
    loss = forward_backward(model, TOKENS, LABELS, GLOBAL_TOKENS)
    grad_dtypes = {str(p.grad.dtype) for p in model.parameters()}
    with recorded_collectives() as calls:
        finalized = finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], device_mesh)
    reduced = Counter(
        str(dtype) for name, dtype, _ in calls if name == "all_reduce" and dtype.is_floating_point
    )
    named = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    grad_error = max(
        (full(p.grad) - named[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    norm, reference_norm = grad_norm([model]).item(), grad_norm([reference]).item()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.step()
        optimizer.zero_grad()
        forward_backward(model, TOKENS, LABELS, GLOBAL_TOKENS)
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], device_mesh)
    state_dtypes = {
        str(t.dtype) for s in optimizer.state.values() for k, t in s.items() if k != "step"
    }
    drifted = []
    for name, parameter in model.named_parameters():
        if not isinstance(parameter, DTensor) or parameter.placements[0].is_replicate():
            local = (
                (parameter.to_local() if isinstance(parameter, DTensor) else parameter)
                .detach()
                .contiguous()
            )
            copies = [torch.empty_like(local) for _ in range(world_size)]
            torch.distributed.all_gather(copies, local, group=device_mesh["tp"].get_group())
            drifted += [name] if not all(torch.equal(copy, local) for copy in copies) else []
    return {
        "loss": (loss, reference_loss),
        "grad_dtypes": grad_dtypes,
        "finalized": finalized,
        "reduced": dict(reduced),
        "grad_error": grad_error / scale,
        "norm": (norm, reference_norm),
        "state_dtypes": state_dtypes,
        "drifted": drifted,
    }


def test_bf16_gradients_take_the_fp32_reduction_paths_end_to_end(ranks2):
    for result in ranks2.run(check_bf16_end_to_end):
        assert result["grad_dtypes"] == {"torch.bfloat16"}
        assert result["finalized"] > 0  # SP norms' Partial gradients were summed
        # Every floating all-reduce of finalisation and replica sync ran in fp32 on bf16 gradients.
        assert set(result["reduced"]) == {"torch.float32"} and sum(result["reduced"].values()) >= 2
        loss, reference_loss = result["loss"]
        assert loss == pytest.approx(reference_loss, rel=1e-3)
        assert result["grad_error"] < 3e-2
        assert result["norm"][0] == pytest.approx(result["norm"][1], rel=1e-3)
        assert result["state_dtypes"] == {
            "torch.bfloat16"
        }  # torch AdamW keeps bf16 moments for bf16 params
        assert result["drifted"] == []


def check_fsdp_bf16_mixed(rank, world_size):
    config, policy = tiny_config("llama"), precision_policy("bf16-mixed")
    device_mesh = mesh((2, 2), ("dp", "tp"))
    reference = build_causal_lm(config, seed=0)
    reference_loss = forward_backward(reference, TOKENS, LABELS, GLOBAL_TOKENS)
    model = _tp_model(config, device_mesh["tp"], False)
    shard_data_parallel(model, device_mesh["dp"], policy.fsdp_policy())
    broadcast_tp_replicas([model], device_mesh)
    dp_rank = device_mesh["dp"].get_local_rank()
    with _FunctionalCollectives() as recorder, policy.autocast("cpu", fsdp=True):
        local = forward_backward(
            model, TOKENS.chunk(2)[dp_rank], LABELS.chunk(2)[dp_rank], GLOBAL_TOKENS
        )
    loss = torch.tensor(local, dtype=torch.float64)
    torch.distributed.all_reduce(loss, group=device_mesh["dp"].get_group())
    finalize_dtensor_gradients([model])
    synchronize_tp_replica_gradients([model], device_mesh)
    named = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    grad_error = max(
        (full(p.grad) - named[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    return {
        "loss": (loss.item(), reference_loss),
        "param_dtypes": {str(p.dtype) for p in model.parameters()},
        "grad_dtypes": {str(p.grad.dtype) for p in model.parameters()},
        "bf16_collectives": sum(
            n for (_, dtype), n in recorder.calls.items() if dtype == "torch.bfloat16"
        ),
        "grad_error": grad_error / scale,
    }


def test_fsdp_bf16_mixed_keeps_fp32_shards_and_gradients(ranks4):
    for result in ranks4.run(check_fsdp_bf16_mixed):
        assert result["param_dtypes"] == {"torch.float32"} and result["grad_dtypes"] == {
            "torch.float32"
        }
        assert (
            result["bf16_collectives"] > 0
        )  # FSDP's bf16 compute: the TP activations move in bf16
        loss, reference_loss = result["loss"]
        assert loss != reference_loss and loss == pytest.approx(reference_loss, rel=1e-3)
        assert result["grad_error"] < 3e-2


# --- the policy itself (no ranks)
# -------------------------------------------------------------------


def test_policies_from_names():
    fp32, mixed, bf16 = (precision_policy(name) for name in ("fp32", "bf16-mixed", "bf16"))
    assert (fp32.param_dtype, fp32.compute_dtype, fp32.mixed) == (
        torch.float32,
        torch.float32,
        False,
    )
    assert (mixed.param_dtype, mixed.compute_dtype, mixed.mixed) == (
        torch.float32,
        torch.bfloat16,
        True,
    )
    assert (bf16.param_dtype, bf16.compute_dtype, bf16.mixed) == (
        torch.bfloat16,
        torch.bfloat16,
        False,
    )
    assert (
        mixed.fsdp_policy().param_dtype == torch.bfloat16
        and mixed.fsdp_policy().reduce_dtype == torch.float32
    )
    assert (
        fp32.fsdp_policy().param_dtype is None and bf16.fsdp_policy().reduce_dtype == torch.float32
    )


def test_autocast_only_for_bf16_mixed_without_fsdp():
    mixed = precision_policy("bf16-mixed")
    with mixed.autocast("cpu", fsdp=False):
        assert (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
    for policy, data_parallel in (
        (mixed, True),
        (precision_policy("fp32"), False),
        (precision_policy("bf16"), False),
    ):
        with policy.autocast("cpu", data_parallel):
            assert not torch.is_autocast_enabled("cpu")


def test_unknown_precision_is_refused():
    with pytest.raises(
        ValueError, match="train.precision='fp16' is not one of fp32, bf16-mixed, bf16"
    ):
        precision_policy("fp16")
