"""LoRA against full fine-tuning: tokens/s and peak memory per rank, the recipe itself.

    .venv/bin/python bench/lora.py [--tp 1 2] [--rounds 2] [--steps 5]

A Llama of hidden 768, 4 layers (12 heads of 64, 4 KV heads, intermediate 2048), fp32, seq_len
128, 8 sequences per step in micro-batches of 4, AdamW; ``peft=lora`` with the default rank 8 on
the attention and MLP projections. Each (tp, method) runs ``--steps`` steps per round, the methods
alternated within a round; the figures are the median ``tokens_per_s`` over the steps after the
first and the largest ``peak_memory_gib`` (the busiest rank's peak RSS), the median over rounds;
beside them the dry run's planned ``optimizer`` and ``total`` per rank (``plan.json``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, head_dim=64)
SHAPE |= dict(num_key_value_heads=4, intermediate_size=2048)
METHODS = {"full": [], "lora": ["peft=lora"]}


def overrides(tp: int, method: str, steps: int) -> list[str]:
    shape = [f"model.config.{key}={value}" for key, value in SHAPE.items()]
    run = [f"tp={tp}", f"train.max_steps={steps}", "train.seq_len=128", "train.val_every=0"]
    run += ["train.global_batch_size=8", "train.micro_batch_size=4", "checkpoint.export=false"]
    return [*shape, *run, *METHODS[method], "data.num_examples=400"]


def _recipe(arguments: list[str]) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "recipes/finetune.py", *arguments]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")


def run_figures(arguments: list[str], output: Path) -> dict:
    """One recipe run of ``arguments`` into ``output``: the median ``tokens_per_s`` over the steps
    after the first and the largest ``peak_memory_gib`` (bench/memory_levers.py uses it too)."""
    _recipe([*arguments, f"output_dir={output}", "overwrite_output_dir=true"])
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    speed = statistics.median(record["tokens_per_s"] for record in records[1:])
    return {"tokens_per_s": speed, "peak_gib": max(r["peak_memory_gib"] for r in records)}


def plan_figures(arguments: list[str], output: Path) -> dict:
    """The dry run of ``arguments``: its planned ``optimizer`` and ``total`` GiB per rank."""
    _recipe([*arguments, "dry_run=true", f"output_dir={output}"])
    per_rank = json.loads((output / "plan.json").read_text())["per_rank_gib"]
    return {"planned_optimizer_gib": per_rank["optimizer"], "planned_total_gib": per_rank["total"]}


def measure(tp: int, method: str, steps: int, root: Path) -> dict:
    return run_figures(overrides(tp, method, steps), root / f"{method}_tp{tp}")


def planned(tp: int, method: str, root: Path) -> dict:
    return plan_figures(overrides(tp, method, 1), root / f"plan_{method}_tp{tp}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        rounds: dict[tuple[int, str], list[dict]] = {}
        for _ in range(args.rounds):
            for tp in args.tp:
                for method in METHODS:
                    found = measure(tp, method, args.steps, root)
                    rounds.setdefault((tp, method), []).append(found)
        columns = "tokens/s | peak GiB/rank | planned optimizer GiB | planned total GiB"
        print(f"| tp | method | {columns} |")
        print("|---|---|---|---|---|---|")
        for (tp, method), found in rounds.items():
            speed = statistics.median(r["tokens_per_s"] for r in found)
            peak = statistics.median(r["peak_gib"] for r in found)
            plan = planned(tp, method, root)
            print(
                f"| {tp} | {method} | {speed:.0f} | {peak:.3f} | "
                f"{plan['planned_optimizer_gib']:.4f} | {plan['planned_total_gib']:.3f} |"
            )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
