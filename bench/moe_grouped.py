"""Experts: tokens/s of grouped GEMM (``torch._grouped_mm``) against the per-expert loop it
replaced.

Why: ``components.moe.expert_parallel`` ran its local experts one pair of matmuls at a time,
each behind a ``torch.where`` (issue 27); it now sorts the rows by expert once and runs two
grouped GEMMs over all local experts. The acceptance is grouped >= 2x the loop's tokens/s at 64
experts top-8, tp = 1.

Model: a stack of ``LAYERS`` Qwen3-MoE sparse blocks (transformers' ``Qwen3MoeSparseMoeBlock``:
top-k router, fused experts ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], SiLU),
residual between blocks, from ``tiny_config("qwen3_moe", **SIZES)`` with seeded random weights,
fp32: 64 experts, top-8, hidden 512, expert intermediate 256 (Qwen3-30B-A3B's 2048 / 768 and 128
experts, scaled to a 2-core CPU). A step is forward and backward of ``TOKENS`` tokens (the loss:
the mean square of the output) with SGD.

Paths, on the same weights and batches:

- tp = 1, one process: the experts' forward is the folded path's with the ep group left out
  (every expert local, no collective): ``run_experts_loop`` or ``run_experts_grouped`` on the
  (token, choice) rows.
- ep = 2 and 4 (``--ep``), gloo, 1 thread per rank, every rank its own tokens:
  ``apply_expert_parallel`` on a ``("ep_shard", "ep")`` mesh of (1, ep), with
  ``grouped_mm_fits`` answering False or as it does (the all-to-all path). 4 ranks on 2 cores
  are oversubscribed.

Time: paths alternate step by step (the order rotates), ``WARMUP`` warm-up steps then ``STEPS``
timed ones, each after a barrier; a step's time is the slowest rank's; the median is reported,
tokens/s = ranks x ``TOKENS`` / median. The load average is printed at the start and the end
(the machine is shared).

Guard: the first step's loss of both paths agrees to 1e-5 relative, and their outputs to 1e-5
relative."""

import argparse
import os
import statistics
import sys
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from components.moe import apply_expert_parallel, expert_compute
from components.moe.expert_compute import run_experts_grouped, run_experts_loop
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group
from recipes.tiny_models import tiny_config

SIZES = {
    "hidden_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}
LAYERS = 2
TOKENS = 1024  # per rank per step
STEPS, WARMUP = 8, 1
PATHS = ("loop", "grouped")
_FITS = expert_compute.grouped_mm_fits
RTOL = 1e-5


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = tiny_config("qwen3_moe", **SIZES)
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Qwen3MoeSparseMoeBlock(config) for _ in range(LAYERS))
        for block in self.layers:
            for parameter in block.parameters():
                nn.init.normal_(parameter, std=0.02)

    def forward(self, hidden):
        for block in self.layers:
            hidden = hidden + block(hidden)
        return hidden


def _local_forward(function):
    """Every expert local, no collective: the folded path's forward with the ep group left out."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        token = torch.arange(hidden_states.shape[0]).repeat_interleave(k)
        rows = function(
            self,
            hidden_states[token],
            top_k_index.reshape(-1),
            self.gate_up_proj,
            self.down_proj,
            top_k_weights.reshape(-1),
        )
        return torch.zeros_like(hidden_states).index_add(0, token, rows)

    return forward


def build(path: str, ep: int) -> Stack:
    stack = Stack()
    if ep == 1:
        function = run_experts_loop if path == "loop" else run_experts_grouped
        for block in stack.layers:
            block.experts.forward = types.MethodType(_local_forward(function), block.experts)
    else:
        mesh = init_device_mesh("cpu", (1, ep), mesh_dim_names=("ep_shard", "ep"))
        apply_expert_parallel(stack, mesh, None, ["layers.*.experts"])
    return stack


def _never_fits(*args) -> bool:
    return False


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(1, TOKENS, SIZES["hidden_size"], generator=generator)


def step(stack: Stack, hidden: torch.Tensor) -> tuple[float, torch.Tensor]:
    for parameter in stack.parameters():
        parameter.grad = None
    output = stack(hidden)
    loss = output.pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for parameter in stack.parameters():
            parameter.sub_(parameter.grad, alpha=1e-3)
    return loss.item(), output.detach()


def measure(ep: int, rank: int) -> dict:
    """Both paths alternately; on ep > 1 inside the launched process group."""
    torch.set_num_threads(1)
    stacks = {path: build(path, ep) for path in PATHS}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    first: dict[str, tuple[float, torch.Tensor]] = {}
    for index in range(WARMUP + STEPS):
        shift = index % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            hidden = batch(index, rank)
            if ep > 1:
                dist.barrier()
            # ep > 1, the loop: as where grouped GEMM cannot run (read at call time)
            expert_compute.grouped_mm_fits = _FITS if path == "grouped" else _never_fits
            started = time.perf_counter()
            loss, output = step(stacks[path], hidden)
            elapsed = time.perf_counter() - started
            if index == 0:
                first[path] = (loss, output)
            if index >= WARMUP:
                times[path].append(elapsed)
    slowest = torch.tensor([times[path] for path in PATHS], dtype=torch.float64)
    if ep > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    (loss_a, out_a), (loss_b, out_b) = first["loop"], first["grouped"]
    return {
        "median_s": {path: statistics.median(slowest[i].tolist()) for i, path in enumerate(PATHS)},
        "loss_rel": abs(loss_a - loss_b) / abs(loss_a),
        "output_rel": ((out_a - out_b).abs().max() / out_a.abs().max()).item(),
    }


def _rank(ep: int) -> dict:
    init_process_group("gloo", timedelta(minutes=10))
    try:
        return measure(ep, dist.get_rank())
    finally:
        dist.destroy_process_group()


def _memory_rank(ep: int) -> dict:
    """Expert bytes this rank keeps after one AdamW step (weights, gradients, moments), with the
    experts replicated over ep_shard and sharded over it; the world is ep x ep_shard ranks."""
    from components.distributed.grads import finalize_dtensor_gradients

    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("ep_shard", "ep"))
    result = {}
    try:
        for shard in (False, True):
            stack = Stack()
            apply_expert_parallel(stack, mesh, None, ["layers.*.experts"], shard_experts=shard)
            optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-3)
            stack(batch(0, dist.get_rank())).pow(2).mean().backward()
            finalize_dtensor_gradients([stack])
            optimizer.step()
            experts = [p for n, p in stack.named_parameters() if ".experts." in n]
            moments = [v for p in experts for v in optimizer.state[p].values() if v.dim()]
            kept = [p.to_local() for p in experts] + [p.grad.to_local() for p in experts]
            kept += [v.to_local() for v in moments]
            gathered = sum(p.to_local().numel() * p.element_size() for p in experts)
            result["sharded" if shard else "replicated"] = {
                "bytes": sum(t.numel() * t.element_size() for t in kept),
                "weights": gathered,
            }
        return result
    finally:
        dist.destroy_process_group()


def memory(world: int = 4, ep: int = 2) -> list[str]:
    """The memory table: expert bytes per rank, replicated vs sharded over ep_shard = world / ep."""
    result = launch_local(_memory_rank, world, ep)
    replicated = max(r["replicated"]["bytes"] for r in result.values())
    sharded = max(r["sharded"]["bytes"] for r in result.values())
    mib = 1024 * 1024
    weights = max(r["replicated"]["weights"] for r in result.values())
    return [
        f"Expert memory per rank ({world} ranks, ep={ep}, ep_shard={world // ep}, tp=1; weights + "
        "gradients + AdamW moments after one step, the largest rank):",
        "",
        "| experts over ep_shard | MiB per rank | x replicated |",
        "|---|---|---|",
        f"| replicated | {replicated / mib:.1f} | 1.00 |",
        f"| sharded (shard_experts=True) | {sharded / mib:.1f} | {sharded / replicated:.2f} |",
        "",
        f"Sharded, each forward also gathers this rank's {weights / mib:.1f} MiB of expert "
        "weights, kept from a layer's forward to its backward.",
        "",
        f"{'PASS' if sharded <= 0.55 * replicated else 'MISS'} moe_grouped memory: sharded / "
        f"replicated {sharded / replicated:.2f} (goal <= 0.55)",
    ]


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ep_help = "1 (one process), 2, 4 (gloo)"
    parser.add_argument("--ep", type=int, nargs="*", default=[1], help=ep_help)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per path")
    parser.add_argument("--memory", action="store_true", help="only the expert memory table")
    args = parser.parse_args(argv)
    globals()["STEPS"] = args.steps
    if args.memory:
        print("\n".join(memory()))
        return 0
    print(f"load average at start: {_load()}", flush=True)
    rows = []
    # The launches first: fork only from a process that has not started worker threads.
    for ep in sorted(args.ep, key=lambda ep: ep == 1):
        started = time.perf_counter()
        result = measure(ep, 0) if ep == 1 else launch_local(_rank, ep, ep)[0]
        rows.append((ep, result, time.perf_counter() - started))
        print(f"ep={ep} done in {time.perf_counter() - started:.0f} s, load {_load()}", flush=True)
    print(f"load average at end: {_load()}")
    print()
    print(
        f"Qwen3-MoE blocks x{LAYERS}: hidden {SIZES['hidden_size']}, "
        f"{SIZES['num_experts']} experts x {SIZES['moe_intermediate_size']}, "
        f"top-{SIZES['num_experts_per_tok']}, fp32, {TOKENS} tokens per rank per step, "
        f"forward + backward + SGD; median of {STEPS} steps after {WARMUP} warm-up, paths "
        "alternated, 1 thread per rank"
    )
    print()
    print("| ranks | ep | loop ms | grouped ms | loop tokens/s | grouped tokens/s | grouped/loop |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    rows.sort(key=lambda row: row[0])
    for ep, result, _ in rows:
        loop, grouped = result["median_s"]["loop"], result["median_s"]["grouped"]
        tokens = ep * TOKENS
        print(
            f"| {ep} | {ep if ep > 1 else '1 (tp=1)'} | {loop * 1e3:.0f} | {grouped * 1e3:.0f} "
            f"| {tokens / loop:,.0f} | {tokens / grouped:,.0f} | {loop / grouped:.2f}x |"
        )
    print()
    for ep, result, _ in rows:
        ratio = result["median_s"]["loop"] / result["median_s"]["grouped"]
        guard = result["loss_rel"] <= RTOL and result["output_rel"] <= RTOL
        failed |= not guard or (ep == 1 and ratio < 2)
        goal = f"grouped / loop {ratio:.2f}x" + (" (goal >= 2x)" if ep == 1 else "")
        print(
            f"{'PASS' if guard and (ep > 1 or ratio >= 2) else 'MISS'} moe_grouped ep={ep}: "
            f"{goal}; "
            f"step-1 loss rel {result['loss_rel']:.1e}, output rel {result['output_rel']:.1e} "
            f"(goal <= {RTOL:g})"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
