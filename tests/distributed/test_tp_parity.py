"""Tensor parallelism trains the same model as one process: loss, gradients, grad norm, updates.

Each check builds the same seeded tiny model twice on every rank: once whole (the single-process
reference, computed locally) and once parallelised by the plan. Both see the same global batch; with
dp > 1 each dp rank takes its share. fp32 throughout; tolerances are from the issue (loss 1e-5
relative, gradients and weights 1e-5 absolute, grad norm 1e-6 relative); measured differences are
~1e-7.

By default tp=2 runs Qwen3 with sequence parallelism and Llama without, tp=4 and dp=2 x tp=2 Qwen3
(with sp at tp=4); the other families and sp settings of each run with ``-m sweep``.
"""

import unittest.mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from components.distributed import tp_plan
from components.distributed.float8_tp import float8_style
from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import finalize_dtensor_gradients, grad_norm
from components.distributed.layout import resolve_parallel_dims
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import (
    _is_tp_replicated,
    _iter_unique_parameters_by_name,
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm, materialize_pretrained, meta_causal_lm
from components.models.families import plan_for
from components.moe import apply_expert_parallel
from components.moe.expert_parallel import expert_layout
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import mesh

BATCH, SEQ, PROMPT = 4, 16, 3


def global_batch(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    tokens = torch.randint(
        0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed)
    )
    labels = tokens.clone()
    labels[:, :PROMPT] = -100  # a prompt masked out of the loss
    return tokens, labels, int((labels[:, 1:] != -100).sum())


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def finish(model, device_mesh) -> float:
    finalize_dtensor_gradients([model])
    synchronize_tp_replica_gradients([model], device_mesh)
    return grad_norm([model]).item()


def check_parity(rank, world_size, family, tp, sequence_parallel):
    return parity(world_size, tiny_config(family), tp, sequence_parallel)


def replicated_names(model, device_mesh) -> list[str]:
    """Parameters that are TP replicas after every transformation (plan, expert parallelism)."""
    peers = tuple(dist.get_process_group_ranks(device_mesh["tp"].get_group()))
    unmarked = {id(p) for p, _ in _iter_unique_parameters_by_name([model])}
    return [
        name
        for name, parameter in model.named_parameters()
        if id(parameter) in unmarked and _is_tp_replicated(parameter, peers, dist.get_rank(), "tp")
    ]


def parity(
    world_size, config, tp, sequence_parallel, pretrained_path=None, ep=1, experts=(), mode=None
) -> dict:
    """Train one step (then five) both ways; with ``pretrained_path`` the parallel model is built on
    the meta device, sharded, and loaded slice by slice, the reference with ``from_pretrained``.
    With ``ep > 1`` the modules matching ``experts`` are split by expert over the MoE mesh
    (``mode``: the dispatch path, None for the automatic one)."""
    dims = resolve_parallel_dims(world_size, tp=tp, ep=ep)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    tokens, labels, global_tokens = global_batch(config.vocab_size)

    if pretrained_path is None:
        reference, model = build_causal_lm(config, seed=0), build_causal_lm(config, seed=0)
    else:
        reference, model = (
            AutoModelForCausalLM.from_pretrained(pretrained_path),
            meta_causal_lm(config),
        )
    reference_loss = forward_backward(reference, tokens, labels, global_tokens) / global_tokens
    reference_norm = grad_norm([reference]).item()

    apply_tp_plan(
        model, device_mesh["tp"], plan_for(config, sequence_parallel), config, sequence_parallel
    )
    moe_mesh = mesh((dims.ep_shard, dims.ep), ("ep_shard", "ep"))
    for name in apply_expert_parallel(model, moe_mesh, device_mesh["tp"], list(experts)):
        if mode is not None:  # the other dispatch path at this shape: the layout is data
            module = model.get_submodule(name)
            per_rank = module.layout.experts_per_rank
            module.layout = expert_layout(moe_mesh, device_mesh["tp"], per_rank, mode)
    if pretrained_path is not None:
        materialize_pretrained(model, pretrained_path)
    if dims.dp > 1:
        shard_data_parallel(model, device_mesh["dp"])
    broadcast_tp_replicas([model], device_mesh)
    dp_rank = device_mesh["dp"].get_local_rank()
    local_loss = forward_backward(
        model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
    )
    loss = torch.tensor(local_loss, dtype=torch.float64)
    dist.all_reduce(loss, group=device_mesh["dp"].get_group())
    norm = finish(model, device_mesh)

    named_reference = dict(reference.named_parameters())
    grad_error = max(
        (full(p.grad) - named_reference[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    )

    for optimized in (model, reference):
        torch.optim.SGD(optimized.parameters(), lr=1.0).step()
    weight_error = max(
        (full(p.detach()) - named_reference[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    )

    # Five AdamW steps on the parallel model alone: every TP-replicated tensor must stay bitwise
    # equal.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(5):
        optimizer.zero_grad()
        forward_backward(
            model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
        )
        finish(model, device_mesh)
        optimizer.step()
    parameters = dict(model.named_parameters())
    drifted = []
    tp_group = device_mesh["tp"].get_group()
    replicated = replicated_names(model, device_mesh)
    for name in replicated:
        local = full(parameters[name].detach()).contiguous()
        copies = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(copies, local, group=tp_group)
        if not all(torch.equal(copy, local) for copy in copies):
            drifted.append(name)
    return {
        "loss": loss.item() / global_tokens,
        "reference_loss": reference_loss,
        "norm": norm,
        "reference_norm": reference_norm,
        "grad_error": grad_error,
        "weight_error": weight_error,
        "replicated": len(replicated),
        "drifted": drifted,
    }


def assert_parity(results):
    for result in results:
        assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
        assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-6)
        assert result["grad_error"] < 1e-5
        assert result["weight_error"] < 1e-5
        assert result["replicated"] > 0 and result["drifted"] == []


SWEEP = pytest.mark.sweep


@pytest.mark.parametrize(
    ("family", "sequence_parallel"),
    [
        pytest.param("qwen3", True, id="sp-qwen3"),
        pytest.param("llama", False, id="plain-llama"),
        pytest.param("qwen3", False, id="plain-qwen3", marks=SWEEP),
        pytest.param("llama", True, id="sp-llama", marks=SWEEP),
    ],
)
def test_tp2_matches_one_process(ranks2, family, sequence_parallel):
    assert_parity(ranks2.run(check_parity, family, 2, sequence_parallel))


@pytest.mark.parametrize(
    ("family", "sequence_parallel"),
    [
        pytest.param("qwen3", True, id="sp-qwen3"),
        pytest.param("llama", False, id="plain-llama", marks=SWEEP),
        pytest.param("qwen3", False, id="plain-qwen3", marks=SWEEP),
        pytest.param("llama", True, id="sp-llama", marks=SWEEP),
    ],
)
def test_tp4_matches_one_process(ranks4, family, sequence_parallel):
    assert_parity(ranks4.run(check_parity, family, 4, sequence_parallel))


@pytest.mark.parametrize("family", ["qwen3", pytest.param("llama", marks=SWEEP)])
def test_dp2_tp2_matches_one_process(ranks4, family):
    assert_parity(ranks4.run(check_parity, family, 2, False))


def check_fp8_parity(rank, world_size, sequence_parallel):
    """tp=2 against one process, both converted to float8 linears (tensorwise, emulated as on the
    recipe's CPU): torchao's float8 TP styles (all three without sp; Float8ColwiseParallel alone
    with sp over gloo, components/distributed/float8_tp.py)."""
    from components.models.fp8 import Fp8Options, convert_to_fp8

    config = tiny_config("llama")
    dims = resolve_parallel_dims(world_size, tp=world_size)
    device_mesh = mesh((dims.dp, dims.tp), ("dp", "tp"))
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    options = Fp8Options(recipe="tensorwise", data_parallel=False, emulate=True)
    reference, model = build_causal_lm(config, seed=0), build_causal_lm(config, seed=0)
    for converted in (reference, model):
        convert_to_fp8(converted, options)
    reference_loss = forward_backward(reference, tokens, labels, global_tokens) / global_tokens
    chosen = []  # the float8 styles the plan applied, recorded on their way

    def recorded(*args):
        chosen.append(type(style := float8_style(*args)).__name__)
        return style

    plan = plan_for(config, sequence_parallel)
    with unittest.mock.patch.object(tp_plan, "float8_style", recorded):
        apply_tp_plan(model, device_mesh["tp"], plan, config, sequence_parallel)
    loss = forward_backward(model, tokens, labels, global_tokens) / global_tokens
    finish(model, device_mesh)
    named_reference = dict(reference.named_parameters())
    grad_error = max(
        ((full(p.grad) - named_reference[n].grad).norm() / named_reference[n].grad.norm()).item()
        for n, p in model.named_parameters()
    )
    styles = sorted(set(chosen) - {"NoneType"})
    return {"loss": loss, "reference": reference_loss, "grad_error": grad_error, "styles": styles}


FLOAT8_STYLES = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_fp8_tp2_matches_one_fp8_process(ranks2, sequence_parallel):
    """The same float8 casts both ways (tensorwise scales from DTensor-wide maxima, fp32 around the
    emulated matmuls), so what is left is summation order: measured, the loss equal and the
    gradients 5e-7 apart (relative norm); bands 1e-5 and 1e-4."""
    for result in ranks2.run(check_fp8_parity, sequence_parallel):
        assert result["styles"] == (FLOAT8_STYLES[:1] if sequence_parallel else FLOAT8_STYLES)
        assert result["loss"] == pytest.approx(result["reference"], rel=1e-5)
        assert result["grad_error"] < 1e-4


def check_fp8_fsdp(rank, world_size):
    """dp=2 against one process, both with float8 linears; FSDP2 all-gathers them in float8
    (torchao's ``fsdp_pre_all_gather`` hands it e4m3 data; counted as FSDP calls it)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from components.models.fp8 import Fp8Options, convert_to_fp8

    config = tiny_config("llama")
    device_mesh = mesh((world_size,), ("dp",))
    tokens, labels, global_tokens = global_batch(config.vocab_size)
    reference, model = build_causal_lm(config, seed=0), build_causal_lm(config, seed=0)
    convert_to_fp8(reference, Fp8Options(recipe="tensorwise", data_parallel=False, emulate=True))
    convert_to_fp8(model, Fp8Options(recipe="tensorwise", data_parallel=True, emulate=True))
    # the reference takes one dp rank's rows at a time too: each forward's activation scale is then
    # that rank's (a tensorwise scale is the maximum of its own micro-batch)
    shards = list(zip(tokens.chunk(world_size), labels.chunk(world_size), strict=True))
    reference_loss = sum(forward_backward(reference, *shard, global_tokens) for shard in shards)
    shard_data_parallel(model, device_mesh["dp"])
    gathered = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counted(self, *args):
        outputs = original(self, *args)
        gathered.extend(output.dtype for output in outputs[0])
        return outputs

    with unittest.mock.patch.object(
        WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", counted
    ):
        local = forward_backward(model, *shards[rank], global_tokens)
    loss = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(loss)
    return {"loss": loss.item(), "reference": reference_loss, "gathered": gathered}


def test_fp8_dp2_all_gathers_float8_and_matches_one_fp8_process(ranks2):
    """7 linears a layer, 2 layers, gathered for forward and again for backward: 28 float8
    gathers. The loss measured equal (the same casts, fp32 around the matmuls); band 1e-5."""
    for result in ranks2.run(check_fp8_fsdp):
        assert result["gathered"] == [torch.float8_e4m3fn] * 28
        assert result["loss"] == pytest.approx(result["reference"], rel=1e-5)
