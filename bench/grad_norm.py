"""The exact 2-norm of SmolLM2-135M's gradients: per-tensor float64 norms against the chunked
float64 sum of squares ``components/distributed/grads.py`` uses on the CPU; float32 for scale.

    .venv/bin/python bench/grad_norm.py [--threads 1 2] [--reps 7]

Why: the recipe clips at the global norm every step; at 1 thread on SmolLM2-135M the per-tensor
``torch._foreach_norm(..., dtype=torch.float64)`` was most of the recipe's host work (BENCHMARKS.md,
"Step overhead"). Random gradients of the model's 272 shapes (134.5 M elements, fp32); the three
ways alternate, in a rotating order, ``--reps`` times; medians. Each one's error is against the
sum of squares of a float64 copy (``torch.cat`` of the widened gradients).
"""

import argparse
import os
import statistics
import time

import torch

from components.distributed.grads import float64_sum_of_squares

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def smollm2_shapes() -> list[tuple[int, ...]]:
    """SmolLM2-135M's trainable shapes: tied embedding, 30 decoder layers, the final norm."""
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    layer += [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    layer += [(HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN), *layer * LAYERS, (HIDDEN,)]


def per_tensor_float64(grads: list[torch.Tensor]) -> torch.Tensor:
    """The recipe's 2-norm before issue 49: float64 norms per tensor, squared and summed."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    return torch.stack(list(norms)).pow(2).sum()


def float32_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """What ``torch.nn.utils.get_total_norm`` computes (float32 per-tensor norms), squared."""
    return torch.stack(list(torch._foreach_norm(grads, 2.0))).double().pow(2).sum()


WAYS = {
    "per_tensor_float64": per_tensor_float64,
    "chunked_float64": float64_sum_of_squares,
    "float32": float32_norms,
}


def run(threads: int, reps: int) -> None:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * 1e-3 for shape in smollm2_shapes()]
    exact = torch.cat([grad.reshape(-1).double() for grad in grads]).pow(2).sum()
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    errors: dict[str, float] = {}
    names = list(WAYS)
    for rep in range(reps + 1):  # the first round warms up
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            started = time.perf_counter()
            value = WAYS[name](grads)
            if rep:
                times[name].append(time.perf_counter() - started)
            errors[name] = abs(value.item() - exact.item()) / exact.item()
    print(f"\n{threads} thread(s), {sum(g.numel() for g in grads):,} elements, median of {reps}")
    print("| way | ms | × per_tensor_float64 | relative error |\n|---|---|---|---|")
    base = statistics.median(times["per_tensor_float64"])
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {errors[name]:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for threads in args.threads:
        run(threads, args.reps)
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
