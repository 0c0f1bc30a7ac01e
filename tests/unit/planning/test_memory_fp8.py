"""The memory model counts fp8 (components/planning/memory_model.py), on the parallel meta model of
a fake world: under FSDP with tensorwise scaling a block's float8 linears are all-gathered at 1
byte a weight instead of bf16's 2; without FSDP each converted weight's bf16 autocast copy gives
way to one float8 cast at a time (1 byte, the largest weight's)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore as Store

from components.distributed.layout import resolve_parallel_dims
from components.models.conversion import convert_model
from components.models.fp8 import Fp8Options
from components.models.parallelize import build_parallel_model
from components.planning.memory_model import Layout, Step, estimate_memory
from recipes.tiny_models import tiny_config
from tests.harness import spec_for

CONFIG = tiny_config("llama", vocab_size=96, hidden_size=256, intermediate_size=512, head_dim=32)
PROJECTIONS = 256 * 256 * 2 + 256 * 128 * 2 + 256 * 512 * 3  # q, o; k, v; gate, up, down


@pytest.fixture
def fake_world(request):
    dist.init_process_group("fake", store=Store(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def detail(dp: int, precision: str, recipe: str = "tensorwise") -> dict:
    dims = resolve_parallel_dims(dp, tp=1)
    fp8 = Fp8Options(recipe=recipe, data_parallel=dp > 1) if precision == "fp8" else None
    convert = functools.partial(convert_model, lora=None, fp8=fp8, seed=0)
    spec = spec_for(CONFIG, precision=precision)
    model, _ = build_parallel_model(
        spec, dims, dims.build_meshes("cpu"), torch.device("meta"), convert=convert
    )
    layout = Layout(dims=dims, micro_batch_size=1, activation_checkpointing="none")
    step = Step(
        seq_len=64, global_batch_size=dp, precision=precision, sequence_parallel=False,
        optimizer_moments=2, device_type="cuda", runtime_gib=0.0, loss_chunk_tokens=0,
        fp8_recipe=recipe,
    )  # fmt: skip
    return {k: v * 2**30 for k, v in estimate_memory(model, CONFIG, layout, step).detail.items()}


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_fsdp_all_gathers_the_float8_weights_at_one_byte(fake_world):
    mixed, fp8 = detail(2, "bf16-mixed"), detail(2, "fp8")
    # two layers in flight, each all-gathered: the converted weights 1 byte each, not 2
    assert mixed["fsdp_layers"] - fp8["fsdp_layers"] == pytest.approx(2 * PROJECTIONS)
    assert fp8["fp8_weight_casts"] == 0  # the gathered float8 weight is the matmul's operand
    rowwise = detail(2, "fp8", "rowwise")  # all-gathers bf16, casts each weight itself
    assert rowwise["fsdp_layers"] == mixed["fsdp_layers"]
    assert rowwise["fp8_weight_casts"] == 256 * 512


@pytest.mark.parametrize("fake_world", [1], indirect=True)
def test_without_fsdp_a_float8_cast_replaces_the_autocast_copies(fake_world):
    mixed, fp8 = detail(1, "bf16-mixed"), detail(1, "fp8")
    layers = CONFIG.num_hidden_layers
    saved = 2 * PROJECTIONS * layers  # bf16 copies of every converted weight
    assert mixed["autocast_weight_copies"] - fp8["autocast_weight_copies"] == saved
    assert fp8["fp8_weight_casts"] == 256 * 512  # the largest converted weight, 1 byte
