"""Expert parallelism: tokens/s and bytes moved per step, folded EP against all-to-all dispatched
EP.

Why: ``components.moe.dispatch_mode`` picks the folded path wherever ``ep`` divides ``tp`` on the
assumption that it is the cheaper one (no token moves, one all-reduce each way), and the all-to-all
path only where it must (an ep group that spans data-parallel ranks). ``expert_layout(...,
mode)`` can set either path at a shape where both fit; this script measures both there, and
the all-to-all path alone at the shapes only it can run (experts over data-parallel ranks).

Model: Qwen3-MoE from config (``SIZES``: hidden 256, 8 experts of intermediate 256, top-2, 2 layers,
8 heads), seeded random weights (``build_causal_lm(..., seed=0)``), fp32; global batch ``BATCH`` ×
``SEQ`` tokens per step, split over dp. Per shape: ``apply_tp_plan`` when tp > 1 (experts and
routers left to expert parallelism), ``apply_expert_parallel`` on the ``("ep_shard", "ep")`` mesh
(``ParallelDims.build_meshes``' experts) with the path forced, ``shard_data_parallel`` when
dp > 1, AdamW. A step is the recipe's: ``forward_backward``, ``finalize_dtensor_gradients``,
``synchronize_tp_replica_gradients``, ``optimizer.step()``.

Time: one gloo process group per world size (``launch_local``), 1 thread per rank; at each shape one
model per path, built from the same seed, stepped alternately on the same batches (the order rotates
every step). Step 1 is a warm-up (and the correctness guard); then ``STEPS`` timed steps, each after
a barrier; a step's time is the slowest rank's, the median is reported; tokens/s = ``BATCH`` ×
``SEQ`` / median. 4 ranks on 2 cores are oversubscribed (two ranks per core): their times include
waiting for a core.

Bytes: every collective the experts make goes through ``components.moe.collectives``
(``expert_parallel`` calls no collective itself), which looks ``dist`` up in its own globals at call
time. The bench replaces that one name with a counting proxy of ``torch.distributed``: the calls
counted are exactly the experts' (forward and backward), never FSDP's, the TP plan's or the replica
sync's. Each call adds the bytes this rank must send under the bandwidth-optimal algorithm, from the
tensors it is given: ``all_to_all_single``: the rows it addresses to other ranks (its input split
sizes without its own; counts, hidden rows, expert ids, results, and backward the reverse);
``all_gather_single``: its block × (n − 1); ``all_reduce``: 2(n − 1)/n × the buffer (ring). Figures
are per rank per step, averaged over the timed steps, the mean over ranks (and the busiest rank).

Analytic (uniform routing), per rank per step, L MoE layers, T tokens per dp rank, H hidden, k =
top-k, 4-byte activations: folded: all-reduce of T·H (forward) and T·(H + k) (backward), × 2(ep −
1)/ep; all-to-all: with t = T/tp tokens after the TP split, R = t·k·(ep − 1)/ep rows leave the rank,
4 exchanges of R·H·4 bytes (dispatch, combine, and both reversed in backward) + R int64 expert ids +
(ep − 1) int64 counts; when tp > 1 the TP gather of the output block (t·H) forward and of the hidden
and routing-weight gradients (t·(H + k)) backward, × (tp − 1). Real routing is not uniform (and rows
routed to a rank's own experts stay home), so measured/analytic ≠ 1.

Guard: the step-1 loss of each path equals the other path's at the same shape and a one-process
forward of the same model and batch, to 1e-5 relative.
"""

import os
import statistics
import sys
import time
import types
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

import components.moe.collectives as moe_collectives
from components.distributed.fsdp import shard_data_parallel
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.layout import resolve_parallel_dims
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import synchronize_tp_replica_gradients
from components.models import build_causal_lm
from components.models.families import FAMILIES, plan_for
from components.moe import apply_expert_parallel
from components.moe.expert_parallel import expert_layout
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.tiny_models import tiny_config

SIZES = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
EXPERTS, ROUTERS = FAMILIES["qwen3_moe"].experts, FAMILIES["qwen3_moe"].routers
BATCH, SEQ = 4, 256
STEPS = 30  # timed steps per shape, after 1 warm-up step
WARMUP = 1
LOSS_RTOL = 1e-5
MIB = 1024 * 1024
KINDS = ("all_to_all", "all_gather", "all_reduce")
BOTH = ("folded", "all_to_all")
# world -> (tp, ep, paths): the fair comparison where both paths fit, the all-to-all path alone
# where only it does
SHAPES: dict[int, list[tuple[int, int, tuple[str, ...]]]] = {
    2: [(2, 2, BOTH), (1, 2, ("all_to_all",))],
    4: [(4, 4, BOTH), (4, 2, BOTH), (2, 2, BOTH), (2, 4, ("all_to_all",))],
}


def config():
    return tiny_config("qwen3_moe", **SIZES)


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The global batch of ``step``: the same on every rank and for every path; labels = tokens."""
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return tokens, tokens.clone(), BATCH * (SEQ - 1)


# --- counting the experts' collectives
# -----------------------------------------------------------------


class Counter:
    """Per collective kind: calls and bytes this rank sends, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, float] = defaultdict(float)

    def add(self, kind: str, sent: float) -> None:
        if self.on:
            self.calls[kind] += 1
            self.bytes[kind] += sent

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def counting_dist(counter: Counter) -> types.SimpleNamespace:
    """``torch.distributed`` with the three collectives of ``components.moe.collectives``
    counted."""

    def all_to_all_single(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw
    ):
        n, me = dist.get_world_size(group), dist.get_rank(group)
        row = input.element_size() * (input[0].numel() if input.dim() and input.shape[0] else 0)
        splits = input_split_sizes or [input.shape[0] // n] * n
        counter.add("all_to_all", sum(rows for r, rows in enumerate(splits) if r != me) * row)
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, **kw
        )

    def all_gather_single(output, input, group=None, **kw):
        counter.add(
            "all_gather", (dist.get_world_size(group) - 1) * input.numel() * input.element_size()
        )
        return dist.all_gather_single(output, input, group=group, **kw)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, **kw):
        n = dist.get_world_size(group)
        counter.add("all_reduce", 2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, op=op, group=group, **kw)

    proxy = types.SimpleNamespace(
        **{name: getattr(dist, name) for name in dir(dist) if not name.startswith("__")}
    )
    vars(proxy).update(
        all_to_all_single=all_to_all_single,
        all_gather_single=all_gather_single,
        all_reduce=all_reduce,
    )
    return proxy


def analytic(tp: int, ep: int, dp: int, path: str) -> dict[str, float]:
    """Bytes per rank per step under uniform routing, per collective kind (see the module
    docstring)."""
    layers, hidden, k = (
        SIZES["num_hidden_layers"],
        SIZES["hidden_size"],
        SIZES["num_experts_per_tok"],
    )
    tokens = BATCH // dp * SEQ
    if path == "folded":
        ring = 2 * (ep - 1) / ep
        return {"all_reduce": layers * ring * 4 * (tokens * hidden + tokens * (hidden + k))}
    block = -(-tokens // tp)
    rows = block * k * (ep - 1) / ep
    out = {"all_to_all": layers * (4 * rows * hidden * 4 + rows * 8 + (ep - 1) * 8)}
    if tp > 1:
        out["all_gather"] = layers * (tp - 1) * 4 * (block * hidden + block * (hidden + k))
    return out


# --- ranks
# ---------------------------------------------------------------------------------------------


def _build(world: int, tp: int, ep: int, path: str):
    cfg = config()
    dims = resolve_parallel_dims(world, tp=tp, ep=ep)
    meshes = dims.build_meshes("cpu")
    mesh = meshes.world
    model = build_causal_lm(cfg, seed=0)
    if tp > 1:
        apply_tp_plan(model, mesh["tp"], plan_for(cfg), cfg, moe_modules=EXPERTS + ROUTERS)
    moe_mesh = meshes.experts
    for name in apply_expert_parallel(model, moe_mesh, mesh["tp"], list(EXPERTS)):
        module = model.get_submodule(name)  # either path at this shape: the layout is data
        per_rank = module.layout.experts_per_rank
        module.layout = expert_layout(moe_mesh, mesh["tp"], per_rank, path)
    if dims.dp > 1:
        shard_data_parallel(model, mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, mesh, dims


def _step(run, step: int, vocab: int) -> float:
    """One training step on this rank's share of ``step``'s batch; the summed token loss of this dp
    rank."""
    model, optimizer, mesh, dims = run
    tokens, labels, global_tokens = batch(step, vocab)
    dp_rank = mesh["dp"].get_local_rank()
    optimizer.zero_grad()
    loss = forward_backward(
        model, tokens.chunk(dims.dp)[dp_rank], labels.chunk(dims.dp)[dp_rank], global_tokens
    )
    finalize_dtensor_gradients([model])
    synchronize_tp_replica_gradients([model], mesh)
    optimizer.step()
    return loss


def _shape(
    world: int, tp: int, ep: int, paths: tuple[str, ...], counter: Counter, vocab: int
) -> dict:
    runs = {path: _build(world, tp, ep, path) for path in paths}
    dp = runs[paths[0]][3].dp
    times: dict[str, list[float]] = {path: [] for path in paths}
    calls: dict[str, dict[str, int]] = {}
    sent: dict[str, dict[str, float]] = {}
    first_loss: dict[str, float] = {}
    for path in paths:
        calls[path], sent[path] = defaultdict(int), defaultdict(float)
    for step in range(WARMUP + STEPS):
        for path in paths[step % len(paths) :] + paths[: step % len(paths)]:
            counter.reset()
            counter.on = step >= WARMUP
            dist.barrier()
            started = time.perf_counter()
            loss = _step(runs[path], step, vocab)
            elapsed = time.perf_counter() - started
            counter.on = False
            if step < WARMUP:
                total = torch.tensor(loss, dtype=torch.float64)
                dist.all_reduce(total, group=runs[path][2]["dp"].get_group())
                first_loss[path] = total.item() / batch(step, vocab)[2]
                continue
            times[path].append(elapsed)
            for kind in KINDS:
                calls[path][kind] += counter.calls[kind]
                sent[path][kind] += counter.bytes[kind]
    del runs
    # Slowest rank per step; bytes per step: this rank's mean, then the mean and the max over ranks.
    slowest = torch.tensor([times[path] for path in paths], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_rank = torch.tensor(
        [[sent[path][kind] / STEPS for kind in KINDS] for path in paths], dtype=torch.float64
    )
    gathered = [torch.empty_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_rank)
    stacked = torch.stack(gathered)  # [ranks, paths, kinds]
    return {
        "tp": tp,
        "ep": ep,
        "dp": dp,
        "paths": {
            path: {
                "median_s": statistics.median(slowest[i].tolist()),
                "times_s": slowest[i].tolist(),
                "calls": {kind: calls[path][kind] // STEPS for kind in KINDS},
                "mean_bytes": {
                    kind: stacked[:, i, j].mean().item() for j, kind in enumerate(KINDS)
                },
                "max_total": stacked[:, i, :].sum(dim=1).max().item(),
                "loss": first_loss[path],
            }
            for i, path in enumerate(paths)
        },
    }


def _rank(world: int) -> list[dict]:
    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(1)
    counter = Counter()
    moe_collectives.dist = counting_dist(counter)
    vocab = config().vocab_size
    try:
        return [_shape(world, tp, ep, paths, counter, vocab) for tp, ep, paths in SHAPES[world]]
    finally:
        moe_collectives.dist = dist
        dist.destroy_process_group()


# --- report
# --------------------------------------------------------------------------------------------


def reference_loss() -> float:
    """Step 1's mean token loss of the same model in one process (the guard's reference)."""
    torch.set_num_threads(1)
    cfg = config()
    tokens, labels, global_tokens = batch(0, cfg.vocab_size)
    return evaluate_loss_sum(build_causal_lm(cfg, seed=0), tokens, labels) / global_tokens


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def run(world_sizes: tuple[int, ...] = (2, 4)) -> list[str]:
    """Measure every shape of every world size; print the tables and the goal lines; return the goal
    lines."""
    loads = [f"start {_load()}"]
    results: list[tuple[int, dict]] = []
    for world in world_sizes:
        started = time.perf_counter()
        results += [(world, shape) for shape in launch_local(_rank, world, world)[0]]
        loads.append(f"after {world} ranks ({time.perf_counter() - started:.0f} s) {_load()}")
    reference = (
        reference_loss()
    )  # after the launches: ranks are forked from a parent without worker threads
    lines = [
        f"### Expert dispatch: folded vs all-to-all (Qwen3-MoE hidden {SIZES['hidden_size']}, "
        f"{SIZES['num_experts']} experts × {SIZES['moe_intermediate_size']}, "
        f"top-{SIZES['num_experts_per_tok']}, "
        f"{SIZES['num_hidden_layers']} layers; global batch {BATCH} × {SEQ}; gloo, 1 thread per "
        "rank)",
        "",
        f"Median of the slowest rank over {STEPS} steps after {WARMUP} warm-up, paths alternated; "
        "bytes: sent per "
        "rank per step by the experts' collectives (mean over ranks; max: the busiest rank), "
        "analytic: uniform "
        "routing. 4 ranks run on 2 cores (oversubscribed).",
        "",
        "| ranks | tp | ep | dp | path | median ms | tokens/s | tokens/s × folded | expert "
        "collectives/step "
        "| MiB/step/rank | max rank | analytic MiB | measured/analytic | step-1 loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    detail = [
        "",
        "By collective (MiB per rank per step, mean over ranks; analytic in brackets):",
        "",
        "| ranks | tp | ep | dp | path | all_to_all | all_gather | all_reduce |",
        "|---|---|---|---|---|---|---|---|",
    ]
    goals = []
    for world, shape in results:
        tp, ep, dp, paths = shape["tp"], shape["ep"], shape["dp"], shape["paths"]
        tag = f"(tp={tp} ep={ep} dp={dp}, {world} ranks)"
        for path, r in paths.items():
            expected = analytic(tp, ep, dp, path)
            measured = sum(r["mean_bytes"].values())
            predicted = sum(expected.values())
            speed = BATCH * SEQ / r["median_s"]
            versus = (
                f"{paths['folded']['median_s'] / r['median_s']:.2f}" if "folded" in paths else "–"
            )
            calls = ", ".join(f"{r['calls'][kind]} {kind}" for kind in KINDS if r["calls"][kind])
            lines.append(
                f"| {world} | {tp} | {ep} | {dp} | {path} | {r['median_s'] * 1e3:.0f} | "
                f"{speed:,.0f} | {versus} "
                f"| {calls} | {measured / MIB:.2f} | {r['max_total'] / MIB:.2f} | "
                f"{predicted / MIB:.2f} "
                f"| {measured / predicted:.2f} | {r['loss']:.6f} |"
            )
            cells = [
                f"{r['mean_bytes'][kind] / MIB:.2f} [{expected.get(kind, 0) / MIB:.2f}]"
                if r["calls"][kind] or kind in expected
                else "–"
                for kind in KINDS
            ]
            detail.append(f"| {world} | {tp} | {ep} | {dp} | {path} | {' | '.join(cells)} |")
            error = abs(r["loss"] - reference) / abs(reference)
            goals.append(
                f"{'PASS' if error <= LOSS_RTOL else 'MISS'} moe_dispatch {tag} {path}: step-1 "
                f"loss {r['loss']:.7f} "
                f"vs one process {reference:.7f}, rel {error:.1e} (goal ≤ {LOSS_RTOL:g})"
            )
        if "folded" in paths and "all_to_all" in paths:
            folded, dispatched = paths["folded"], paths["all_to_all"]
            error = abs(folded["loss"] - dispatched["loss"]) / abs(folded["loss"])
            goals.append(
                f"{'PASS' if error <= LOSS_RTOL else 'MISS'} moe_dispatch {tag}: step-1 loss "
                "folded vs all_to_all "
                f"rel {error:.1e} (goal ≤ {LOSS_RTOL:g})"
            )
            ratio = dispatched["median_s"] / folded["median_s"]
            paired = sorted(
                a / f for a, f in zip(dispatched["times_s"], folded["times_s"], strict=True)
            )
            quartiles = statistics.quantiles(paired, n=4)
            goals.append(
                f"{'PASS' if ratio >= 1 else 'MISS'} moe_dispatch {tag}: folded {ratio:.2f}× the "
                "all_to_all "
                f"path's tokens/s; per-step pairs {statistics.median(paired):.2f}× (quartiles "
                f"{quartiles[0]:.2f}-"
                f"{quartiles[2]:.2f}) (dispatch_mode picks folded here: goal ≥ 1)"
            )
    loads.append(f"end {_load()}")
    lines += detail + ["", f"Load average (1, 5, 15 min): {'; '.join(loads)}."]
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


if __name__ == "__main__":
    run(tuple(int(a) for a in sys.argv[1:]) or (2, 4))
