"""LoRA at tp=2 on gloo ranks: the adapters' placement and replica markers, the optimizer's state
(the adapters' alone, as the memory model plans it, to the byte), and a model loaded from a folder
on the meta device gets the same adapters as one built with its weights. Per-expert adapters at
tp=2 ep=2 are split by expert and train as in one process."""

import dataclasses
import itertools

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients
from components.distributed.layout import ParallelDims
from components.distributed.tp_replicas import (
    synchronize_tp_replica_gradients,
    unmarked_parameters,
)
from components.models import build_causal_lm
from components.models.families import FAMILIES
from components.models.lora import LoraOptions, apply_lora
from components.models.parallelize import build_parallel_model
from components.planning.memory_model import GIB, Layout, MemoryEstimate, Step, estimate_memory
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import spec_for

OPTIONS = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=("*_proj",))
CONFIG = tiny_config("llama", vocab_size=96)


def _adapted(model: torch.nn.Module) -> torch.nn.Module:
    apply_lora(model, OPTIONS, seed=0)
    return model


def _build(world_size: int, weights=None):
    dims = ParallelDims(tp=world_size)
    meshes = dims.build_meshes("cpu")
    spec = spec_for(CONFIG, weights=weights)
    model, report = build_parallel_model(spec, dims, meshes, torch.device("cpu"), convert=_adapted)
    return model, report, meshes.world


def placements_state_and_plan(rank, world_size):
    model, report, mesh = _build(world_size)
    attention = model.model.layers[0].self_attn
    placed = {}
    for short, module in (("q", attention.q_proj), ("o", attention.o_proj)):
        for adapter in ("lora_A", "lora_B"):
            weight = getattr(module, adapter).weight
            placed[f"{short}.{adapter}"] = (
                weight.placements if isinstance(weight, DTensor) else "plain"
            )
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    forward_backward(model, tokens, tokens.clone(), tokens.numel(), loss_chunk_tokens=0)
    finalize_dtensor_gradients([model])
    synchronize_tp_replica_gradients([model], mesh)
    clip_grad_norm_([model], 1.0)
    optimizer.step()
    local = [
        v.to_local() if isinstance(v, DTensor) else v
        for s in optimizer.state.values()
        for v in s.values()
    ]
    moments = sum(t.numel() * t.element_size() for t in local if t.dim() > 0)
    planned = _planned_optimizer_bytes(model, CONFIG, tp=world_size, ep=1)
    replicated = {k: v for k, v in report.replicated.items() if ".lora_" in k}
    return placed, moments, planned, replicated, len(optimizer.state) == len(trained)


def _planned_optimizer_bytes(model, config, tp: int, ep: int) -> float:
    """The memory model's optimizer state per rank (AdamW, fp32), in bytes."""
    return planned(model, config, ParallelDims(tp=tp, ep=ep)).optimizer * GIB


def planned(model, config, dims: ParallelDims, nf4_base: bool = False) -> MemoryEstimate:
    """The memory model's plan of ``model`` at ``dims``: AdamW, fp32, 2 rows of 16 tokens
    (``nf4_base``: peft=qlora's)."""
    layout = Layout(dims=dims, micro_batch_size=2, activation_checkpointing="none")
    step = Step(
        seq_len=16,
        global_batch_size=2,
        precision="fp32",
        sequence_parallel=False,
        optimizer_moments=2,
        device_type="cpu",
        runtime_gib=0.0,
        loss_chunk_tokens=0,
        packing=False,
        nf4_base=nf4_base,
    )
    return estimate_memory(model, config, layout, step)


def test_adapters_are_placed_by_the_base_style_and_the_optimizer_holds_theirs_alone(ranks2):
    for placed, moments, planned, replicated, every_trained in ranks2.run(
        placements_state_and_plan
    ):
        assert placed == {
            "q.lora_A": "plain",  # colwise base: A whole on every rank, B by rows
            "q.lora_B": (Shard(0),),
            "o.lora_A": (Shard(1),),  # rowwise base: A by columns, B whole
            "o.lora_B": "plain",
        }
        assert moments == planned  # exact: AdamW's two moments of the local adapter shards
        assert every_trained
        assert replicated["model.layers.0.self_attn.q_proj.lora_A.weight"] == "sum"
        assert replicated["model.layers.0.self_attn.o_proj.lora_B.weight"] == "mean"
        assert len(replicated) == 2 * 7 * 2 // 2  # one replicated adapter per projection


def adapters_built_and_loaded(rank, world_size, folder):
    built, _, _ = _build(world_size)
    loaded, _, _ = _build(world_size, weights=folder)
    differing = []
    for (name, ours), (_, theirs) in zip(
        built.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        a = ours.to_local() if isinstance(ours, DTensor) else ours
        b = theirs.to_local() if isinstance(theirs, DTensor) else theirs
        if not torch.equal(a, b):
            differing.append(name)
    lora_a = loaded.model.layers[1].mlp.down_proj.lora_A.weight
    return differing, isinstance(lora_a, DTensor) and lora_a.placements == (Shard(1),), rank


def test_a_model_loaded_on_meta_gets_the_adapters_of_one_built_with_its_weights(ranks2, tmp_path):
    build_causal_lm(CONFIG, seed=0).save_pretrained(tmp_path)
    results = ranks2.run(adapters_built_and_loaded, tmp_path)
    assert results == [([], True, 0), ([], True, 1)]


MOE = tiny_config("qwen3_moe", vocab_size=96)
MOE_EXPERTS, MOE_ROUTERS = FAMILIES["qwen3_moe"].experts, FAMILIES["qwen3_moe"].routers
EXPERT_OPTIONS = dataclasses.replace(OPTIONS, target_modules=("*.q_proj",), experts=MOE_EXPERTS)


def _moe_lora(model: torch.nn.Module) -> torch.nn.Module:
    apply_lora(model, EXPERT_OPTIONS, seed=0)
    return model


def _steps(model, mesh, optimizer, steps: int) -> tuple[list[float], list[float]]:
    """(losses, grad norms) of ``steps`` optimizer steps on fixed batches."""
    losses, norms = [], []
    for step in range(steps):
        tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = forward_backward(model, tokens, tokens.clone(), tokens.numel(), loss_chunk_tokens=0)
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], mesh)
        norms.append(clip_grad_norm_([model], 1e9).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses, norms


def _sgd(model) -> torch.optim.SGD:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def expert_adapters_at_tp2_ep2(rank, world_size):
    reference = _moe_lora(build_causal_lm(MOE, seed=0))
    dims = ParallelDims(tp=world_size, ep=world_size)
    meshes = dims.build_meshes("cpu")
    mesh = meshes.world
    spec = dataclasses.replace(spec_for(MOE), experts=MOE_EXPERTS, routers=MOE_ROUTERS)
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("cpu"), convert=_moe_lora)
    experts = model.model.layers[0].mlp.experts
    placed = {}
    for adapter, weight in itertools.product(("lora_A", "lora_B"), ("gate_up_proj", "down_proj")):
        parameter = getattr(experts, adapter)[weight]
        placed[f"{adapter}.{weight}"] = (parameter.placements, tuple(_local(parameter).shape))
    synced = [name for name, _, _ in unmarked_parameters([model]) if ".experts." in name]
    at_ep1 = dataclasses.replace(dims, ep=1)  # the experts, and so their adapters, TP replicas
    at_ep1_meshes = dataclasses.replace(meshes, experts=None)
    replicas, _ = build_parallel_model(
        spec, at_ep1, at_ep1_meshes, torch.device("cpu"), convert=_moe_lora
    )
    reductions = [r for n, _, r in unmarked_parameters([replicas]) if ".experts.lora_" in n]
    ours = _steps(model, mesh, _sgd(model), 3)
    theirs = _steps(reference, None, _sgd(reference), 3)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _steps(model, mesh, adamw, 1)
    state = [_local(v) for s in adamw.state.values() for v in s.values() if v.dim() > 0]
    adapters = [_local(p) for n, p in model.named_parameters() if ".lora_" in n]
    measured = sum(t.numel() * t.element_size() for t in state)
    expected = 2 * sum(t.numel() * t.element_size() for t in adapters)  # AdamW's two moments
    planned = _planned_optimizer_bytes(model, MOE, tp=world_size, ep=world_size)
    return placed, (synced, reductions), ours, theirs, measured, (expected, planned)


def test_expert_adapters_split_by_ep_train_like_one_process_with_sgd(ranks2):
    for placed, synced, ours, theirs, measured, expected in ranks2.run(expert_adapters_at_tp2_ep2):
        by_expert = (Replicate(), Shard(0))  # ("ep_shard", "ep"): 4 of the 8 experts per rank
        assert placed == {
            "lora_A.gate_up_proj": (by_expert, (4, 4, 64)),
            "lora_A.down_proj": (by_expert, (4, 4, 64)),
            "lora_B.gate_up_proj": (by_expert, (4, 128, 4)),
            "lora_B.down_proj": (by_expert, (4, 64, 4)),
        }
        assert synced[0] == []  # split by expert: never a TP replica
        assert synced[1] == ["mean"] * 2 * 2 * 2  # at ep=1 replicas, as the experts: A, B × 2 × 2
        for ours_values, their_values in zip(ours, theirs, strict=True):  # losses, grad norms
            assert ours_values == pytest.approx(their_values, rel=1e-5)
        assert (measured, measured) == expected  # the local adapters' alone, as planned
