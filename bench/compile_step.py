"""The compiled training step against the eager one on this CPU (inductor, fp32, tp=1, one
thread): the tiny Llama of ``conf/model/llama.yaml`` and one wider Llama, step time ratio.

Why: ``train.compile`` is the GPU speed lever; on a CPU it mostly shows what compiling costs and
whether the blocks compile whole. Each width builds the same seeded model twice, compiles one
(``apply_block_wrappers``, as the recipe does), runs one step of each (the compiled one compiles
there, not timed), then alternates eager and compiled AdamW steps on the same batches, so a change
of load hits both alike; the median step times and their ratio are printed, with Dynamo's graph
breaks and recompilations (``CompileCounts``) and the first step's compile time.
"""

import argparse
import os
import statistics
import time

import torch

from components.models import build_causal_lm
from components.models.compile import apply_block_wrappers
from components.training.compile_counts import CompileCounts
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config

WIDE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8)
WIDE |= dict(num_key_value_heads=4, head_dim=64, num_hidden_layers=4)
WIDTHS = {"tiny (hidden 64, 2 layers)": {}, "wide (hidden 512, 4 layers)": WIDE}


def _step(model, optimizer, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    forward_backward(model, tokens, tokens, tokens.numel() - tokens.shape[0])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def measure(sizes: dict, batch: int, seq_len: int, steps: int) -> dict:
    """Median eager and compiled step seconds over ``steps`` alternating steps of each, the
    compiled model's first step (its compilation) and Dynamo's counts."""
    torch._dynamo.reset()
    config = tiny_config("llama", **sizes)
    models = {kind: build_causal_lm(config, seed=0) for kind in ("eager", "compiled")}
    apply_block_wrappers(models["compiled"], "none", compile=True)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
        for _ in range(steps + 1)
    ]
    counts, times = CompileCounts.start(), {"eager": [], "compiled": []}
    _step(models["eager"], optimizers["eager"], batches[0])
    with counts.step(1):
        first = _step(models["compiled"], optimizers["compiled"], batches[0])
    for number, tokens in enumerate(batches[1:], start=2):
        times["eager"].append(_step(models["eager"], optimizers["eager"], tokens))
        with counts.step(number):
            times["compiled"].append(_step(models["compiled"], optimizers["compiled"], tokens))
    eager, compiled = (statistics.median(times[kind]) for kind in ("eager", "compiled"))
    return dict(
        eager_s=eager,
        compiled_s=compiled,
        first_s=first,
        breaks=counts.breaks,
        recompiled=counts.recompiled,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    lines = [
        "| model | eager step ms | compiled step ms | compiled / eager | first compiled step s "
        "| graph breaks | recompilations |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, sizes in WIDTHS.items():
        found = measure(sizes, arguments.batch, arguments.seq_len, arguments.steps)
        ratio = found["compiled_s"] / found["eager_s"]
        lines.append(
            f"| {label} | {found['eager_s'] * 1e3:.1f} | {found['compiled_s'] * 1e3:.1f} | "
            f"{ratio:.2f} | {found['first_s']:.1f} | {found['breaks']} | {found['recompiled']} |"
        )
        print(lines[-1], flush=True)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
