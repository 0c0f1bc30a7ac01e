"""Context parallelism trains the same model as one process: loss and grad norm of every step.

Each check builds the same seeded tiny model twice on every rank: once whole (the cp=1 reference,
one process, computed locally) and once by ``build_parallel_model`` on a ``("dp", "cp", "tp")``
mesh (FSDP over dp × cp, the context-parallel attention). Both train 4 steps on the same global
batches (each dp rank its share, every cp rank of it the whole micro-batch, computing its zig-zag
half), with SGD or AdamW; fp32 gaps must be within 1e-5 relative (measured: <= 1.3e-7 with SGD,
<= 4.9e-7 with AdamW at lr 3e-3; at lr 1e-2 the loss rises and AdamW amplifies the float order to
6.5e-6 by step 4). Packed rows have documents that cross the cp chunk boundaries. bf16-mixed: 3.6e-3
against the one-process bf16-mixed run. One 4-rank pool serves the module; rank 0 alone computes
the reference. By default qwen3 tp2 cp2 sp and llama cp4 run with both optimizers and packed rows
at tp2 cp2; llama dp2 cp2 and tp2 cp2, and packed rows at dp2 cp2 (also the checkpointing case's
layout), run under ``-m sweep``.
"""

import pytest
import torch
import torch.distributed as dist

from components.distributed.context_parallel import (
    ContextParallel,
    gather_sequence,
    zigzag_indices,
)
from components.distributed.grads import finalize_dtensor_gradients, grad_norm
from components.distributed.layout import resolve_parallel_dims
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm
from components.models.parallelize import build_parallel_model
from components.models.precision import precision_policy
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import meshes, spec_for

BATCH, SEQ, STEPS = 4, 32, 4
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.5}), "adamw": (torch.optim.AdamW, {"lr": 3e-3})}


def step_batch(vocab_size: int, step: int, packed: bool):
    """(input_ids, labels, position_ids, labelled tokens) of one global batch; packed rows hold
    documents of 5..13 tokens, positions restarting at each, its first label -100."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    labels = tokens.clone()
    labels[:, :3] = -100
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    if packed:
        for row in range(BATCH):
            start = 0
            while start < SEQ:
                length = int(torch.randint(5, 14, (1,), generator=generator))
                positions[row, start:] = torch.arange(SEQ - start)
                labels[row, start] = -100
                start += length
    return tokens, labels, positions, int((labels[:, 1:] != -100).sum())


def reference_curve(config, optimizer: str, packed: bool, precision: str) -> list:
    """(loss, grad norm) of each step of the cp=1 run, in this process alone (its own config: the
    parallel model's now names the context-parallel attention)."""
    model = build_causal_lm(tiny_config(config.model_type), seed=0)
    make, options = OPTIMIZERS[optimizer]
    optim = make(model.parameters(), **options)
    compute = precision_policy(precision).autocast("cpu", fsdp=False)
    curve = []
    for step in range(STEPS):
        ids, labels, positions, labelled = step_batch(config.vocab_size, step, packed)
        optim.zero_grad()
        loss = forward_backward(model, ids, labels, labelled, positions, compute)
        curve.append((loss / labelled, grad_norm([model]).item()))
        optim.step()
    return curve


def check_cp(rank, world_size, family, layout, optimizer, packed=False, options=None):
    """Per-step (loss, grad norm) of the context-parallel run and, on rank 0, of the cp=1
    reference (the same seeded run on every rank: once is enough)."""
    options = {"sp": False, "precision": "fp32", "checkpointing": "none", **(options or {})}
    dims = resolve_parallel_dims(world_size, tp=layout["tp"], cp=layout["cp"])
    run_meshes = meshes(dims)
    device_mesh = run_meshes.world
    config = tiny_config(family)
    spec = spec_for(config, options["sp"], options["precision"], options["checkpointing"])
    model, _ = build_parallel_model(spec, dims, run_meshes, torch.device("cpu"))
    broadcast_tp_replicas([model], device_mesh)
    make, kwargs = OPTIMIZERS[optimizer]
    optim = make(model.parameters(), **kwargs)
    cp, dp_rank = ContextParallel.of(device_mesh), device_mesh["dp"].get_local_rank()
    compute = precision_policy(options["precision"]).autocast("cpu", dims.data_parallel > 1)
    curve = []
    for step in range(STEPS):
        ids, labels, positions, labelled = step_batch(config.vocab_size, step, packed)
        share = [tensor.chunk(dims.dp)[dp_rank] for tensor in (ids, labels, positions)]
        optim.zero_grad()
        loss = forward_backward(model, *share[:2], labelled, share[2], compute, cp=cp)
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], device_mesh)
        total = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(total, group=run_meshes.loss.get_group())
        curve.append((total.item() / labelled, grad_norm([model]).item()))
        optim.step()
    if rank > 0:
        return curve, None
    return curve, reference_curve(config, optimizer, packed, options["precision"])


def worst_gap(results) -> float:
    """The largest relative gap in loss or grad norm to rank 0's reference over every step and
    rank."""
    reference = results[0][1]
    return max(
        abs(got - want) / abs(want)
        for curve, _ in results
        for step, expected in zip(curve, reference, strict=True)
        for got, want in zip(step, expected, strict=True)
    )


LAYOUTS = {
    "llama-dp2-cp2": ("llama", {"tp": 1, "cp": 2}, {}),
    "llama-tp2-cp2": ("llama", {"tp": 2, "cp": 2}, {}),
    "qwen3-tp2-cp2-sp": ("qwen3", {"tp": 2, "cp": 2}, {"sp": True}),
    "llama-cp4": ("llama", {"tp": 1, "cp": 4}, {}),
}
SWEEP = ("llama-dp2-cp2", "llama-tp2-cp2")  # qwen3-tp2-cp2-sp's paths, fewer of them


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=pytest.mark.sweep) if name in SWEEP else name for name in LAYOUTS],
)
def test_cp_matches_one_process(ranks4, layout, optimizer):
    family, sizes, options = LAYOUTS[layout]
    assert worst_gap(ranks4.run(check_cp, family, sizes, optimizer, False, options)) <= 1e-5


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param({"tp": 1, "cp": 2}, marks=pytest.mark.sweep, id="dp2-cp2"),
        pytest.param({"tp": 2, "cp": 2}, id="tp2"),
    ],
)
def test_packed_documents_never_attend_across(ranks4, sizes):
    """Documents span the cp chunks; positions restart per document on every rank."""
    options = {"sp": sizes["tp"] > 1}
    assert worst_gap(ranks4.run(check_cp, "llama", sizes, "adamw", True, options)) <= 1e-5


def test_activation_checkpointing_composes(ranks4):
    options = {"checkpointing": "full"}
    gap = worst_gap(ranks4.run(check_cp, "llama", {"tp": 1, "cp": 2}, "adamw", True, options))
    assert gap <= 1e-5


def test_bf16_mixed_composes(ranks4):
    """bf16 compute (FSDP's bf16 parameters here, autocast in the reference): within bf16's
    precision of the one-process bf16-mixed run."""
    options = {"precision": "bf16-mixed"}
    assert (
        worst_gap(ranks4.run(check_cp, "llama", {"tp": 2, "cp": 2}, "adamw", False, options)) < 2e-2
    )


def check_gather(rank, world_size):
    """The gather lays ranks end to end, and its gradient is the sum of every rank's slice."""
    group = dist.group.WORLD
    local = torch.full((1, 2, 3, 4), float(rank), requires_grad=True)
    gathered = gather_sequence(local, group)
    weights = (
        torch.arange(world_size * 3, dtype=torch.float32).repeat_interleave(4).view(1, 1, -1, 4)
    )
    (gathered * weights * (rank + 1)).sum().backward()
    return gathered[0, 0, :, 0].tolist(), local.grad[0, 0, :, 0].tolist()


def test_gather_and_its_gradient(ranks4):
    results = ranks4.run(check_gather)
    scale = sum(range(1, 5))  # every rank's (rank + 1) weighs the slices
    for rank, (values, grad) in enumerate(results):
        assert values == [float(r) for r in range(4) for _ in range(3)]
        assert grad == [float(scale * (rank * 3 + i)) for i in range(3)]


def test_zigzag_covers_the_sequence_with_equal_causal_work():
    for size in (1, 2, 4):
        shares = [zigzag_indices(16, rank, size) for rank in range(size)]
        assert sorted(torch.cat(shares).tolist()) == list(range(16))
        work = {int((share + 1).sum()) for share in shares}  # keys each query attends to
        assert len(work) == 1
    with pytest.raises(ValueError, match="not divisible by 2 × cp"):
        zigzag_indices(12, 0, 4)
