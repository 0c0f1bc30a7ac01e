"""Which TP style a float8 linear gets (components/distributed/float8_tp.py): torchao's float8
styles on NCCL (a CUDA mesh) with or without sequence parallelism; over gloo (a CPU mesh) under
sequence parallelism only ``Float8ColwiseParallel`` (the other two would all-gather float8 bytes,
which gloo cannot carry); the plain styles for rowwise scaling and for modules not in float8."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

from components.distributed.float8_tp import float8_style
from components.models import build_causal_lm
from components.models.fp8 import Fp8Options, convert_to_fp8
from recipes.tiny_models import tiny_config

FLOAT8 = {
    "colwise": Float8ColwiseParallel,
    "rowwise": Float8RowwiseParallel,
    "mlp_input": PrepareFloat8ModuleInput,
}
MODULES = {"colwise": "mlp.up_proj", "rowwise": "mlp.down_proj", "mlp_input": "mlp"}


def styles(recipe: str, device_type: str, sequence_parallel: bool) -> dict[str, type | None]:
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    convert_to_fp8(model, Fp8Options(recipe=recipe, data_parallel=False, emulate=True))
    block, mesh = model.model.layers[0], SimpleNamespace(device_type=device_type)
    chosen = {
        name: float8_style(name, block.get_submodule(path), sequence_parallel, mesh)
        for name, path in MODULES.items()
    }
    chosen["lm_head"] = float8_style("colwise", model.lm_head, sequence_parallel, mesh)
    return {name: type(style) if style else None for name, style in chosen.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_nccl_takes_torchaos_float8_styles(sequence_parallel):
    assert styles("tensorwise", "cuda", sequence_parallel) == {**FLOAT8, "lm_head": None}


def test_gloo_keeps_the_float8_styles_that_move_no_float8():
    assert styles("tensorwise", "cpu", False) == {**FLOAT8, "lm_head": None}
    colwise_only = {"colwise": Float8ColwiseParallel, "rowwise": None, "mlp_input": None}
    assert styles("tensorwise", "cpu", True) == {**colwise_only, "lm_head": None}


def test_rowwise_scaling_keeps_the_plain_styles():
    assert set(styles("rowwise", "cuda", True).values()) == {None}


def test_gloo_cannot_all_gather_float8_but_carries_its_bytes():
    """Why the CPU keeps plain styles under sequence parallelism. Should a torch release teach gloo
    float8, this fails, and float8_style may give gloo all three styles."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        data = torch.ones(4, 16).to(torch.float8_e4m3fn)
        out = torch.empty_like(data)
        with pytest.raises(RuntimeError, match="Invalid scalar type"):
            dist.all_gather_single(out, data)
        dist.all_gather_single(out.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(out.float(), data.float())
    finally:
        dist.destroy_process_group()
