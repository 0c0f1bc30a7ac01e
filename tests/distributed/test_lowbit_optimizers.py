"""The optimizer-state variants (``optim=adamw8bit``, ``adamw4bit``, ``adamw_bf16``) on DTensor
parameters at tp=2 dp=2 (four gloo ranks, TP plan and FSDP2 as the recipe builds them): the bytes
their live state holds per rank against AdamW's fp32 state (issue 47's bounds: 0.3×, 0.2×, 0.55×),
and the memory model's ``optimizer`` term against the same live bytes, exactly.

A Llama 256 wide (MLP 512, head_dim 32) so that each rank's shard of every matmul weight holds the
4,096 values torchao quantizes from; one step on fixed gradients creates the state. The step
runs eager (``force_eager``): torchao creates its state before its compiled update, which changes
values in place, never the bytes; compiling it cost ~25 of this module's ~50 CPU-s (the compiled
step over TP and FSDP shards at once runs through the command line:
tests/e2e/test_lowbit_optimizers.py).
"""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from components.distributed.layout import ParallelDims
from components.models.parallelize import build_parallel_model
from components.planning.memory_model import Layout, Step, estimate_memory, optimizer_state_bits
from components.targets import target_class
from recipes.tiny_models import tiny_config
from tests.harness import RankPool, spec_for
from tests.selection import selected_params

CONF = Path(__file__).resolve().parents[2] / "conf"
SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=512)
BOUND = {"adamw": 1.0, "adamw8bit": 0.3, "adamw4bit": 0.2, "adamw_bf16": 0.55}


def conf_optim(name: str) -> tuple[str, dict]:
    """conf/optim/NAME.yaml's class and options, as the recipe reads them."""
    import yaml

    options = yaml.safe_load((CONF / "optim" / f"{name}.yaml").read_text())
    return options.pop("_target_"), options


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a local state tensor holds: a torchao quantized one's codes, scales and code table."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    names = getattr(local, "tensor_attrs", None)
    if names:
        return sum(_tensor_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def state_bytes(rank, world_size, name: str) -> tuple[int, float]:
    """(the live moments' bytes on this rank after one step at tp=2 (dp the rest), the memory
    model's optimizer bytes)."""
    dims = ParallelDims(tp=2, dp_shard=world_size // 2)
    meshes = dims.build_meshes("cpu")
    precision = "bf16" if name == "adamw_bf16" else "fp32"
    config = tiny_config("llama", **SIZES)
    spec = spec_for(config, precision=precision)
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("cpu"))
    target, options = conf_optim(name)
    optimizer = target_class("optim", target)(list(model.parameters()), **options)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    with torch.compiler.set_stance("force_eager"):  # the same state, without compiling the step
        optimizer.step()
    live = sum(
        _tensor_bytes(value)
        for state in optimizer.state.values()
        for key, value in state.items()
        if key != "step"
    )
    bits, block = optimizer_state_bits(target, options)
    layout = Layout(dims=dims, micro_batch_size=1, activation_checkpointing="none")
    step = Step(
        seq_len=32,
        global_batch_size=2,
        precision=precision,
        sequence_parallel=False,
        optimizer_moments=2,
        optimizer_bits=bits,
        optimizer_block=block,
        device_type="cpu",
        runtime_gib=0.0,
        loss_chunk_tokens=0,
    )
    planned = estimate_memory(model, config, layout, step).optimizer * 2**30
    return live, planned


@pytest.fixture(scope="module")
def measured(request):
    """Each selected optimizer's state, and AdamW's for the bound."""
    pool = RankPool(4, timeout_s=300)
    names = {*selected_params(request, "name"), "adamw"}
    yield {name: pool.run(state_bytes, name) for name in sorted(names)}
    pool.close()


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adamw_bf16"])
def test_state_bytes_per_rank_are_within_the_bound_of_adamw_fp32(measured, name):
    pairs = zip(measured[name], measured["adamw"], strict=True)
    for rank, ((live, _), (fp32, _)) in enumerate(pairs):
        print(f"{name} rank {rank}: {live} bytes, {live / fp32:.3f} of AdamW's {fp32}")
        assert live <= BOUND[name] * fp32, (rank, live, fp32)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamw4bit", "adamw_bf16"])
def test_memory_model_counts_the_live_state_bytes(measured, name):
    for rank, (live, planned) in enumerate(measured[name]):
        assert planned == pytest.approx(live, rel=1e-9), (rank, planned, live)
