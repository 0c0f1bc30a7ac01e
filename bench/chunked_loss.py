"""Peak memory of the output projection + loss: chunked (``train.loss_chunk_tokens``) vs unchunked.

Why: the unchunked loss holds the fp32 logits of the whole micro-batch (tokens x vocab / tp), their
log-softmax and their gradient; issue 26 asks the chunked head to hold at most 0.25x of that at
vocab 151,936 and 8,192 tokens, at tp=1 and tp=2, with losses and gradients within 1e-6 relative.

Each measurement runs ``lm_head`` + loss forward and backward on fresh leaf tensors (hidden states
[1, tokens, hidden] and the [vocab, hidden] weight, a ``Shard(0)`` DTensor at tp=2: the
``vocab_parallel`` style), the unchunked path as the recipe runs it (``F.linear`` then
``cross_entropy_sum`` inside ``loss_parallel``). Peak memory: the process's peak RSS (``VmHWM``,
reset through ``/proc/self/clear_refs`` before each measurement: ``components.planning.memory``)
minus its RSS just before, so it counts what the head and loss allocate. Chunked and unchunked
alternate, ``--repeats`` times each; load averages are printed beside each (2 shared cores). fp32.
At tp=2 the two ranks are local gloo processes; each reports its own figure.

    .venv/bin/python bench/chunked_loss.py --tp 1
    .venv/bin/python bench/chunked_loss.py --tp 2 --tokens 4096
"""

import argparse
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from components.distributed.chunked_loss import chunked_cross_entropy_sum
from components.distributed.tp_plan import cross_entropy_sum
from components.planning.memory import GIB, current_memory_gib, peak_memory_gib, reset_peak_memory
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group


def _inputs(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, generator=generator)
    weight = torch.randn(args.vocab, args.hidden, generator=generator) * args.hidden**-0.5
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=generator)
    labels[:, : args.tokens // 16] = -100  # a prompt
    return hidden, weight, labels


def _run(chunk: int, hidden, weight, labels, mesh) -> tuple[float, float, float, tuple]:
    """One forward + backward; (loss, peak GiB above the start, seconds, gradients)."""
    hidden = hidden.clone().requires_grad_()
    if mesh is not None:
        weight = distribute_tensor(weight, mesh, [Shard(0)])
    weight = weight.clone().detach().requires_grad_()
    gc.collect()
    start = current_memory_gib("cpu")
    reset_peak_memory("cpu")
    began = time.perf_counter()
    if chunk:
        loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk)
        loss.backward()
    else:
        with loss_parallel():
            inputs = hidden
            if mesh is not None:
                inputs = DTensor.from_local(hidden, mesh, run_check=False)
            loss = cross_entropy_sum(F.linear(inputs, weight), labels)
            loss.backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    seconds = time.perf_counter() - began
    peak = peak_memory_gib("cpu") - start
    grad_weight = weight.grad.full_tensor() if isinstance(weight.grad, DTensor) else weight.grad
    return loss.item(), peak, seconds, (hidden.grad, grad_weight)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def measure(args, mesh=None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    hidden, weight, labels = _inputs(args)
    figures: dict[int, list[tuple[float, float]]] = {0: [], args.chunk: []}
    results = {}
    for repeat in range(args.repeats):
        for chunk in (0, args.chunk) if repeat % 2 == 0 else (args.chunk, 0):
            loss, peak, seconds, grads = _run(chunk, hidden, weight, labels, mesh)
            results[chunk] = (loss, grads)
            figures[chunk].append((peak, seconds))
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            name = f"chunked({chunk})" if chunk else "unchunked"
            print(
                f"rank {rank} repeat {repeat} {name:>15}: peak {peak:6.3f} GiB above start, "
                f"{seconds:6.1f} s, load {load}",
                flush=True,
            )
            del grads
    (chunked_loss, chunked_grads), (loss, grads) = results[args.chunk], results[0]
    errors = [abs(chunked_loss - loss) / abs(loss)] + [
        _relative(a, b) for a, b in zip(chunked_grads, grads, strict=True)
    ]
    best = {chunk: min(peak for peak, _ in runs) for chunk, runs in figures.items()}
    print(
        f"rank {rank} tp={args.tp} vocab={args.vocab} tokens={args.tokens} hidden={args.hidden}: "
        f"peak unchunked {best[0]:.3f} GiB, chunked({args.chunk}) {best[args.chunk]:.3f} GiB, "
        f"ratio {best[args.chunk] / best[0]:.3f}; relative error loss {errors[0]:.1e}, "
        f"grad hidden {errors[1]:.1e}, grad weight {errors[2]:.1e}",
        flush=True,
    )


def _rank_main(args) -> None:
    init_process_group("gloo", timedelta(minutes=30))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.tp))
    mesh = init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
    measure(args, mesh)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"memory unit: GiB ({GIB} bytes); load averages: {os.getloadavg()}", flush=True)
    if args.tp == 1:
        measure(args)
    else:
        launch_local(_rank_main, args.tp, args)


if __name__ == "__main__":
    main()
