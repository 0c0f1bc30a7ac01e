"""``train.cpu_offload`` in the memory model (components/planning/offload.py), on the parallel meta
model of a fake world: on CUDA the device loses the sharded parameters, their gradients and the
optimizer's state and step, which the host holds instead, and keeps FSDP's gathered layers and
each layer's shard staged for its all-gather and its reduce-scatter; on the CPU nothing moves (FSDP
at dp=1 is priced, autocast's weight copies give way to its gathered bf16 layers)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore as Store

from components.distributed.layout import resolve_parallel_dims
from components.models.parallelize import build_parallel_model
from components.planning.memory_model import GIB, Layout, Step, estimate_memory
from recipes.tiny_models import tiny_config
from tests.harness import spec_for

CONFIG = tiny_config(
    "llama", vocab_size=96, hidden_size=256, intermediate_size=512, head_dim=32, num_hidden_layers=8
)
PROJECTIONS = 256 * 256 * 2 + 256 * 128 * 2 + 256 * 512 * 3  # q, o; k, v; gate, up, down
LAYER = PROJECTIONS + 2 * 256  # and its two norms


@pytest.fixture
def fake_world(request):
    dist.init_process_group("fake", store=Store(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def estimate(dp: int, cpu_offload: bool, device_type: str = "cuda", moments: int = 2):
    """bf16-mixed, one micro-batch of 64 tokens per dp rank, AdamW's (or SGD's) moments."""
    dims = resolve_parallel_dims(dp, tp=1)
    spec = dataclasses.replace(spec_for(CONFIG, precision="bf16-mixed"), cpu_offload=cpu_offload)
    model, _ = build_parallel_model(spec, dims, dims.build_meshes("cpu"), torch.device("meta"))
    layout = Layout(dims=dims, micro_batch_size=1, activation_checkpointing="none")
    step = Step(
        seq_len=64, global_batch_size=dp, precision="bf16-mixed", sequence_parallel=False,
        optimizer_moments=moments, device_type=device_type, runtime_gib=0.0, loss_chunk_tokens=0,
        cpu_offload=cpu_offload,
    )  # fmt: skip
    return estimate_memory(model, CONFIG, layout, step)


@pytest.mark.parametrize("moments", [2, 0], ids=["adamw", "sgd"])
@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_offload_on_cuda_moves_the_sharded_state_to_the_host(fake_world, moments):
    kept, moved = estimate(2, False, moments=moments), estimate(2, True, moments=moments)
    assert (moved.params, moved.grads, moved.optimizer) == (0, 0, 0)
    host = moved.host_detail
    assert (host["params"], host["grads"], host["optimizer"]) == (
        kept.params,
        kept.grads,
        kept.optimizer,
    )
    assert host["optimizer"] == pytest.approx(moments * kept.params, rel=1e-12)
    assert moved.host == pytest.approx(sum(host.values()), rel=1e-12)
    # the device: each of two layers in flight staged from the host (fp32 shard) and its
    # reduce-scatter's fp32 output, the rest of the forward as without offload
    staged = 2 * LAYER / 2 * (4 + 4) / GIB
    assert moved.phases["forward"] == pytest.approx(kept.phases["forward"] + staged, rel=1e-9)
    assert moved.phases["optimizer_step"] == 0 and moved.phases["after_backward"] == 0
    assert moved.total == pytest.approx(max(moved.phases.values()), rel=1e-12)
    # the device total loses the shards and the optimizer's state, less the staged shards
    assert moved.total <= kept.total - kept.params - kept.optimizer + staged


@pytest.mark.parametrize("fake_world", [1], indirect=True)
def test_offload_on_the_cpu_moves_nothing_and_prices_fsdp_at_dp_1(fake_world):
    kept, moved = estimate(1, False, "cpu"), estimate(1, True, "cpu")
    assert moved.host == 0 and moved.host_detail == {}
    assert (moved.params, moved.grads, moved.optimizer) == (kept.params, kept.grads, kept.optimizer)
    assert kept.detail["autocast_weight_copies"] > 0 and kept.detail["fsdp_layers"] == 0
    # FSDP's bf16 layers are the matmuls' operands: no autocast copies; two layers gathered
    assert moved.detail["autocast_weight_copies"] == 0
    assert moved.detail["fsdp_layers"] >= 2 * LAYER * (2 + 4) / GIB
