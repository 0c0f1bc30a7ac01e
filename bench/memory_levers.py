"""The memory levers side by side (issue 47): peak memory per rank and tokens/s of full fine-tuning
with ``optim=adamw``, ``adamw8bit``, ``adamw4bit`` and the bf16-state AdamW, LoRA and QLoRA, on one
model through the recipe's command line, each as a ratio to full fine-tuning with ``adamw``.

    .venv/bin/python bench/memory_levers.py [--rounds 2] [--steps 4] [--tp 1]

A Llama of hidden 1024, 8 layers (16 heads of 64, 4 KV heads, intermediate 2816: 0.09 B
parameters, so AdamW's fp32 state is 0.68 GiB), fp32, on records longer than ``seq_len`` 128
(every row full: bench/memory_model.py's), 2 rows a step, the default ``optim.lr``.
``adamw_bf16`` runs with ``train.precision=bf16`` (it refuses any other: its moments are the
parameters' dtype), so its row holds bf16 weights and gradients too. The levers run in a
rotating order per round; a run's figures are bench/lora.py's (the median ``tokens_per_s`` after
step 1, the largest ``peak_memory_gib``), the median over rounds; beside them the dry run's
planned ``optimizer`` and ``total`` per rank.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from lora import plan_figures, run_figures  # bench/, beside this file
from memory_model import write_records

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=64)
SHAPE |= dict(num_key_value_heads=4, intermediate_size=2816)
LEVERS = {
    "adamw": ["optim=adamw"],
    "adamw8bit": ["optim=adamw8bit"],
    "adamw4bit": ["optim=adamw4bit"],
    "adamw_bf16 (bf16 weights)": ["optim=adamw_bf16", "train.precision=bf16"],
    "lora": ["peft=lora"],
    "qlora": ["peft=qlora"],
}


def overrides(lever: str, tp: int, steps: int, data: Path) -> list[str]:
    shape = [f"model.config.{key}={value}" for key, value in SHAPE.items()]
    run = [f"tp={tp}", f"train.max_steps={steps}", "train.seq_len=128", "train.val_every=0"]
    run += ["train.global_batch_size=2", "train.micro_batch_size=2", "checkpoint.export=false"]
    return [*shape, *run, "data=jsonl", f"data.path={data}", *LEVERS[lever]]


def rounds(tp: int, steps: int, count: int, root: Path) -> dict[str, list[dict]]:
    """Every lever once per round, the order rotated by one each round."""
    found: dict[str, list[dict]] = {lever: [] for lever in LEVERS}
    names, data = list(LEVERS), root / "data.jsonl"
    for number in range(count):
        for lever in names[number % len(names) :] + names[: number % len(names)]:
            output = root / f"{number}_{lever.split()[0]}"
            found[lever].append(run_figures(overrides(lever, tp, steps, data), output))
            figures = found[lever][-1]
            print(
                f"  round {number + 1} {lever}: {figures['tokens_per_s']:.1f} tokens/s, "
                f"{figures['peak_gib']:.3f} GiB, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    return found


def table(found: dict[str, list[dict]], plans: dict[str, dict]) -> str:
    speed = {lever: statistics.median(r["tokens_per_s"] for r in found[lever]) for lever in found}
    peak = {lever: statistics.median(r["peak_gib"] for r in found[lever]) for lever in found}
    lines = [
        "| lever | peak GiB/rank | × adamw | tokens/s | × adamw | planned optimizer GiB "
        "| planned total GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for lever in LEVERS:
        plan = plans[lever]
        lines.append(
            f"| {lever} | {peak[lever]:.3f} | {peak[lever] / peak['adamw']:.2f} "
            f"| {speed[lever]:.1f} | {speed[lever] / speed['adamw']:.2f} "
            f"| {plan['planned_optimizer_gib']:.3f} | {plan['planned_total_gib']:.3f} |"
        )
    return "\n".join(lines)


def _stamp() -> str:
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"{now}; load average {' '.join(f'{value:.2f}' for value in os.getloadavg())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    print(f"start: {_stamp()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="memory_levers_") as folder:
        root = Path(folder)
        write_records(root / "data.jsonl")
        found = rounds(args.tp, args.steps, args.rounds, root)
        data = root / "data.jsonl"
        plans = {
            lever: plan_figures(overrides(lever, args.tp, 1, data), root / f"plan{index}")
            for index, lever in enumerate(LEVERS)
        }
    print(table(found, plans))
    print(f"end: {_stamp()}")


if __name__ == "__main__":
    main()
