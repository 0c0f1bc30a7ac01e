"""QLoRA's NF4 base under FSDP on gloo ranks: at dp=2 each rank holds half the tiles (measured on
the live tensors, every ``NF4Tensor`` in the process), whole tiles of the whole tensor as FSDP2
chunks them, which the memory model plans to the byte; and dp=2 trains as one process does on the
whole batch, 3 steps of SGD and of AdamW."""

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients
from components.distributed.layout import ParallelDims
from components.models import build_causal_lm
from components.models.lora import LoraOptions, apply_lora
from components.models.parallelize import build_parallel_model
from components.models.qlora import QLoRALinear, nf4_bytes, quantize_base
from components.planning.memory_model import GIB
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.distributed.test_lora import planned
from tests.harness import spec_for

OPTIONS = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=None)
CONFIG = tiny_config("llama", vocab_size=96)
ROWS, SEQ = 4, 16  # the global batch: ROWS // dp rows on each rank
TABLE_BYTES = 16 * 4  # the one fp32 NF4 code table a rank holds


def _adapted(model: torch.nn.Module) -> torch.nn.Module:
    apply_lora(model, OPTIONS, seed=0)
    return model


def live_nf4_bytes() -> int:
    """Bytes of the storages behind every ``NF4Tensor`` alive in this process, each once: what
    the rank holds of NF4 bases, FSDP's copies and gathered tiles included."""
    gc.collect()
    storages = {}
    for found in gc.get_objects():
        if type(found) is NF4Tensor:
            inner = (found.quantized_data, found.quantized_scalers, found.quantization_factor)
            for tensor in (*inner, found.scaler_mean, found.nf4):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _params_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of the model's parameters: the NF4 bases' by :func:`nf4_bytes`."""
    plain = [p for n, p in model.named_parameters() if not n.endswith(".nf4.tiles")]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in plain]
    return sum(t.numel() * t.element_size() for t in local) + nf4_bytes(model)[0]


def _steps(model, optimizer, rows: slice, steps: int = 3) -> list[tuple[float, float]]:
    """(loss summed over the global batch, grad norm) of ``steps`` steps on one global batch (its
    loss falls); ``rows``: this rank's rows of it."""
    found = []
    tokens = torch.randint(0, 96, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    mine = tokens[rows]
    for _ in range(steps):
        loss = forward_backward(model, mine, mine.clone(), tokens.numel(), loss_chunk_tokens=0)
        total = torch.tensor(loss, dtype=torch.float64)
        if dist.get_world_size() > 1 and rows != slice(None):
            dist.all_reduce(total)
        finalize_dtensor_gradients([model])
        norm = clip_grad_norm_([model], 1e9).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        found.append((total.item(), norm))
    return found


def _optimizer(model, name: str) -> torch.optim.Optimizer:
    trained = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(trained, lr=0.5)
    return torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.01)


def nf4_base_at_dp(rank, world_size, optimizer_name):
    """At dp=``world_size``: the tiles' placement, the bytes held, planned and live (before and
    after training), and the steps; then the same of the one-process model."""
    dims = ParallelDims(dp_shard=world_size)
    spec = dataclasses.replace(spec_for(CONFIG), nf4_base=True)
    model, _ = build_parallel_model(
        spec, dims, dims.build_meshes("cpu"), torch.device("cpu"), _adapted
    )
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QLoRALinear)
    placed = (q_proj.nf4.tiles.placements, tuple(q_proj.nf4.tiles.to_local().shape))
    sharded = {
        "held": nf4_bytes(model)[0],
        "live": live_nf4_bytes(),
        "params": _params_bytes(model),
        "planned": planned(model, CONFIG, dims, nf4_base=True).params * GIB,
    }
    per_rank = ROWS // world_size
    steps = _steps(
        model, _optimizer(model, optimizer_name), slice(rank * per_rank, (rank + 1) * per_rank)
    )
    sharded["live_after"] = live_nf4_bytes()
    del model, q_proj
    whole = _adapted(build_causal_lm(CONFIG, seed=0))
    quantize_base(whole)
    one = {"held": nf4_bytes(whole)[0], "live": live_nf4_bytes()}
    return (
        placed,
        sharded,
        one,
        steps,
        _steps(whole, _optimizer(whole, optimizer_name), slice(None)),
    )


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_at_dp2_each_rank_holds_half_the_nf4_tiles_and_trains_as_one_process(
    ranks2, optimizer_name
):
    for placed, sharded, one, steps, whole_steps in ranks2.run(nf4_base_at_dp, optimizer_name):
        assert placed == ((Shard(0),), (8, 256))  # q_proj [64, 64]: 16 tiles, 8 a rank
        assert sharded["live"] == sharded["held"]  # nothing else alive: no whole copy kept
        assert sharded["live_after"] == sharded["held"]  # FSDP's gathered tiles freed
        assert one["live"] == one["held"]
        assert sharded["held"] / one["held"] == pytest.approx(0.5, abs=0.01)
        assert sharded["planned"] == sharded["params"] - TABLE_BYTES  # the table is not planned
        for (loss, norm), (whole_loss, whole_norm) in zip(steps, whole_steps, strict=True):
            assert loss == pytest.approx(whole_loss, rel=1e-5)
            assert norm == pytest.approx(whole_norm, rel=1e-5)
        assert steps[-1][0] < steps[0][0]
