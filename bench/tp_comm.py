"""TP communication per training step: number and bytes of collectives at tp=2, plain and
sequence-parallel plans.

Why: the cost of tensor parallelism is its collectives. Each plan implies a count (written down
below, with the reasoning, before measuring); a measured count above it means a redundant collective
somewhere (a style that all-gathers per module where one gather could serve several, a gradient
reduced twice).

Counted with ``CommDebugMode`` (``torch.distributed.tensor.debug``), which sees every collective
dispatched as an op: DTensor's functional collectives and the plain ``torch.distributed`` calls of
``tp_replicas`` and ``grads``. Bytes are those of the local input tensor(s) of each call (for an
all-gather, the shard sent; for a reduce-scatter, the full buffer reduced). One step is the
recipe's: 2 micro-batches of [8, 48] tokens (global batch 16), each forward + vocab-parallel loss +
backward, then the optimizer boundary (``finalize_dtensor_gradients``,
``synchronize_tp_replica_gradients``, ``clip_grad_norm_``, ``AdamW.step``). The model is the tiny
Llama (2 layers, vocab 384) at tp=2 on a ("dp", "tp") = (1, 2) mesh.
"""

import warnings
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients
from components.distributed.layout import ParallelDims
from components.distributed.tp_plan import apply_tp_plan, cross_entropy_sum
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm
from components.models.families import plan_for
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group
from recipes.tiny_models import tiny_config

TP = 2
LAYERS = 2
MICRO_BATCHES = 2
PHASES = ("forward", "backward", "boundary")

# Expected collectives per micro-batch (forward, backward) and per step (boundary), L = LAYERS:
#
# plain TP (activations Replicate between blocks):
#   forward:  all_reduce  1 (embedding_rowwise: Partial -> Replicate) + 2L (o_proj, down_proj
# rowwise)             + 3 (vocab-parallel cross entropy: max, sum of exp, target logit)
#   backward: all_reduce  1 (lm_head colwise: input grad Partial -> Replicate) + 2L (the input grads
# of the             attention block and of the MLP block, once each, Megatron's "f" operator)
#   boundary: all_reduce  2 (replica sync: the flag pre-check and one flat buffer of 5 norms) + 1
# (grad norm             of the sharded gradients; replicated gradients are counted locally)
# sequence parallel (activations Shard(1) between blocks, norms on sequence shards):
#   forward:  reduce_scatter 1 (embedding) + 2L (o_proj, down_proj); all_gather 2L (before
# attention, before             the MLP) + 1 (before lm_head); all_reduce 3 (loss)
#   backward: the transpose of each forward collective: all_gather 1 + 2L, reduce_scatter 2L + 1
#   boundary: all_reduce 1 (finalize: the Partial gradients of the sequence-parallel norms, one flat
# buffer)             + 1 (grad norm); the norms are then Replicate DTensors that every rank already
# agrees on, so             the replica sync should have nothing to do.
EXPECTED: dict[str, dict[str, dict[str, int]]] = {
    "plain": {
        "forward": {"all_reduce": 1 + 2 * LAYERS + 3},
        "backward": {"all_reduce": 1 + 2 * LAYERS},
        "boundary": {"all_reduce": 3},
    },
    "sequence parallel": {
        "forward": {
            "reduce_scatter": 1 + 2 * LAYERS,
            "all_gather": 2 * LAYERS + 1,
            "all_reduce": 3,
        },
        "backward": {"all_gather": 1 + 2 * LAYERS, "reduce_scatter": 2 * LAYERS + 1},
        "boundary": {"all_reduce": 2},
    },
}


def _kind(op: object) -> str:
    name = str(op).rsplit(".", 1)[-1].strip("_")
    for kind in (
        "reduce_scatter",
        "all_gather",
        "allgather",
        "all_reduce",
        "allreduce",
        "broadcast",
        "all_to_all",
    ):
        if name.startswith(kind):
            return {"allgather": "all_gather", "allreduce": "all_reduce"}.get(kind, kind)
    return name


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` that also adds up the bytes of each collective's local input tensor(s)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            first = args[0] if args else None
            tensors = first if isinstance(first, list | tuple) else [first]
            kind = _kind(func._overloadpacket)
            self.calls[kind] += 1
            self.bytes[kind] += sum(
                t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
            )
        return out


def _loss_sum(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The recipe's micro-batch loss: explicit positions (for sequence parallelism), summed token
    loss."""
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).expand(batch, seq)
    return cross_entropy_sum(
        model(input_ids=input_ids, position_ids=position_ids).logits, input_ids
    )


def _measure(sequence_parallel: bool) -> dict[str, dict[str, tuple[int, int]]]:
    """(count, bytes) per collective kind per phase, for one recipe step at tp=TP on this rank."""
    mesh = ParallelDims(tp=TP).build_meshes("cpu").world
    config = tiny_config("llama", vocab_size=384)
    model = build_causal_lm(config, seed=0)
    apply_tp_plan(model, mesh["tp"], plan_for(config, sequence_parallel), config, sequence_parallel)
    broadcast_tp_replicas([model], mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)  # the same batches on every TP rank
    batches = [torch.randint(0, 384, (8, 48), generator=generator) for _ in range(MICRO_BATCHES)]
    tokens = sum(int(b[:, 1:].numel()) for b in batches)
    modes = {phase: CommBytesMode() for phase in PHASES}
    for input_ids in batches:
        with loss_parallel():
            with modes["forward"]:
                loss = _loss_sum(model, input_ids)
            with modes["backward"]:
                (loss / tokens).backward()
    with modes["boundary"]:
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], mesh)
        clip_grad_norm_([model], 1.0)
        optimizer.step()
    return {
        phase: {kind: (mode.calls[kind], mode.bytes[kind]) for kind in mode.calls}
        for phase, mode in modes.items()
    }


def _rank() -> dict[str, dict[str, dict[str, tuple[int, int]]]]:
    init_process_group("gloo", timedelta(minutes=5))
    torch.set_num_threads(1)
    try:
        with (
            warnings.catch_warnings()
        ):  # CommDebugMode's module hooks warn about HF's non-tensor outputs
            warnings.simplefilter("ignore", UserWarning)
            return {"plain": _measure(False), "sequence parallel": _measure(True)}
    finally:
        dist.destroy_process_group()


def run() -> list[str]:
    """Measure both plans; print the table and the goal lines (measured = expected); return the goal
    lines."""
    result = launch_local(_rank, TP)[0]
    lines = [
        f"### TP collectives per training step (tiny Llama, {LAYERS} layers, tp={TP}, "
        f"{MICRO_BATCHES} micro-batches)",
        "",
        "Forward and backward: summed over the step's micro-batches; expected = the plan's count "
        "× micro-batches.",
        "",
        "| plan | phase | collective | measured count | expected count | KiB (local input) |",
        "|---|---|---|---|---|---|",
    ]
    goals = []
    for plan, phases in result.items():
        mismatches = []
        for phase in PHASES:
            scale = 1 if phase == "boundary" else MICRO_BATCHES
            expected = {kind: count * scale for kind, count in EXPECTED[plan][phase].items()}
            for kind in sorted(set(phases[phase]) | set(expected)):
                count, size = phases[phase].get(kind, (0, 0))
                lines.append(
                    f"| {plan} | {phase} | {kind} | {count} | {expected.get(kind, 0)} | "
                    f"{size / 1024:.1f} |"
                )
                if count != expected.get(kind, 0):
                    mismatches.append(f"{phase} {kind} {count} vs {expected.get(kind, 0)}")
        total = sum(count for phase in PHASES for count, _ in phases[phase].values())
        expected_total = sum(
            count * (1 if phase == "boundary" else MICRO_BATCHES)
            for phase in PHASES
            for count in EXPECTED[plan][phase].values()
        )
        goals.append(
            f"{'PASS' if not mismatches else 'MISS'} tp_comm ({plan}): {total} collectives per "
            "step, "
            f"expected {expected_total}" + (f" ({'; '.join(mismatches)})" if mismatches else "")
        )
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


if __name__ == "__main__":
    run()
