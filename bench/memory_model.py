"""The memory model against measurement (issue 25, deliverable 3): predicted ``total`` per rank
(``dry_run=true``'s plan.json) beside the measured ``peak_memory_gib`` of the same recipe run.

Each configuration runs twice through the real command line, one after the other: a dry run, then
``train.max_steps`` steps (metrics.jsonl; the measured figure is the run's largest
``peak_memory_gib``, the busiest rank's peak RSS within a step: ``components.planning.memory``).
The shape is the issue's: a Llama built from its config with hidden 768, 8 layers, seq 1024,
micro-batch 4 (no accumulation), tp 1 and 2 × activation checkpointing none and full × fp32 and
bf16-mixed. The data is a JSONL file written here of records longer than ``seq_len``, so every row
is full (the plan's tokens are micro-batch × seq_len); ``--data embedded``: the recipe's own
embedded data instead (no ``data=`` override, as a first run has it), whose rows are a few dozen
tokens, so the recipe pads a micro-batch to far fewer positions (the plan's ``batch_positions``).
``OMP_NUM_THREADS=1``; malloc as the recipe sets it (``components/runtime/malloc.py``: glibc's
tcache and fast bins off, so the RSS reads as the live bytes); ``--malloc glibc``: glibc's own
defaults (``GLIBC_TUNABLES`` naming a default value, so the recipe leaves them), whose freed heap
blocks stay resident beside the live ones; ``--malloc fixed``: glibc's mmap threshold fixed at
64 KiB (``MALLOC_MMAP_THRESHOLD_``), the live bytes exactly. Every output under a temporary folder.
Goal: predicted within 20 % of measured, every row.

    .venv/bin/python bench/memory_model.py [--only 1:fp32:none,2:bf16-mixed:full] [--steps 3]
    .venv/bin/python bench/memory_model.py --data embedded --malloc glibc
    .venv/bin/python bench/memory_model.py --speed 3 --steps 6 --only 1:fp32:none [--malloc fixed]

``--speed N``: what a malloc setting costs in speed (``--malloc``'s against glibc's defaults): per
configuration, N runs of each, alternating (which goes first alternates too); a run's figure is the
median ``tokens_per_s`` of its steps after the first; printed: each side's median and the ratio.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
CONFIGS = [
    (tp, precision, checkpointing)
    for tp in (1, 2)
    for precision in ("fp32", "bf16-mixed")
    for checkpointing in ("none", "full")
]
TOLERANCE = 0.2
MALLOC = {
    "recipe": {},  # the recipe's own settings (components/runtime/malloc.py)
    "glibc": {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"},  # a default value: the recipe's off
    "fixed": {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)},  # each larger block its own mapping
}


def write_records(path: Path, records: int = 48, words: int = 2500) -> None:
    """Records whose response alone is longer than 1024 tokens: every row is cut to seq_len."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with path.open("w") as file:
        for index in range(records):
            text = " ".join(
                "".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(words)
            )
            file.write(json.dumps({"prompt": f"Continue {index}:", "response": text}) + "\n")


def overrides(
    data: Path | None, tp: int, precision: str, checkpointing: str, steps: int
) -> list[str]:
    """The recipe's command-line overrides of one configuration (dry run and real run alike);
    ``data`` None: the embedded data."""
    model = [f"model.config.{key}={value}" for key, value in MODEL.items()]
    return [
        "model=llama",
        *model,
        f"tp={tp}",
        *(["data=jsonl", f"data.path={data}"] if data is not None else []),
        "train.seq_len=1024",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        f"train.max_steps={steps}",
        "train.val_every=0",
        f"train.precision={precision}",
        f"train.activation_checkpointing={checkpointing}",
        "checkpoint.every_steps=0",
        "checkpoint.export=false",
    ]


def recipe(arguments: list[str], log: Path, malloc: dict | None = None) -> None:
    """Run the recipe's command line with one intra-op thread per rank; fail loudly."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(malloc or {})}
    command = [sys.executable, "recipes/finetune.py", *arguments]
    with log.open("w") as output:
        done = subprocess.run(command, cwd=REPO, env=environment, stdout=output, stderr=output)
    if done.returncode:
        raise SystemExit(
            f"{' '.join(command)} exited {done.returncode}:\n{log.read_text()[-3000:]}"
        )


def measure(folder: Path, data: Path | None, config: tuple, steps: int, malloc: dict) -> dict:
    """One configuration: the plan's per-rank figures, then the measured peaks of a real run."""
    tp, precision, checkpointing = config
    name = f"tp{tp}_{precision}_{checkpointing}"
    arguments = overrides(data, *config, steps)
    plan_dir, run_dir = folder / f"{name}_plan", folder / f"{name}_run"
    plan_arguments = [*arguments, "dry_run=true", f"output_dir={plan_dir}"]
    recipe(plan_arguments, folder / f"{name}_plan.log", malloc)  # as a user would: both alike
    plan = json.loads((plan_dir / "plan.json").read_text())
    started = time.perf_counter()
    recipe([*arguments, f"output_dir={run_dir}"], folder / f"{name}_run.log", malloc)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    peaks = [json.loads(line)["peak_memory_gib"] for line in lines]
    predicted, measured = plan["per_rank_gib"]["total"], max(peaks)
    return {
        "tp": tp,
        "precision": precision,
        "checkpointing": checkpointing,
        "predicted_gib": predicted,
        "measured_gib": measured,
        "batch_positions": plan["batch_positions"],
        "ratio": predicted / measured,
        "peaks_per_step": peaks,
        "per_rank_gib": plan["per_rank_gib"],
        "detail_gib": plan["detail_gib"],
        "run_s": time.perf_counter() - started,
    }


def speed(
    folder: Path, data: Path | None, config: tuple, steps: int, times: int, malloc: str
) -> dict:
    """Median tokens/s (steps after the first) of ``times`` runs per allocator, alternated."""
    rates: dict[str, list[float]] = {malloc: [], "glibc": []}
    for repetition in range(times):
        order = [(malloc, MALLOC[malloc]), ("glibc", MALLOC["glibc"])]
        for name, setting in order if repetition % 2 == 0 else order[::-1]:
            run_dir = folder / f"speed_{name}_{repetition}"
            arguments = [*overrides(data, *config, steps), f"output_dir={run_dir}"]
            recipe(arguments, folder / f"speed_{name}_{repetition}.log", setting)
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            per_step = [json.loads(line)["tokens_per_s"] for line in lines[1:]]
            rates[name].append(statistics.median(per_step))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"config": config, "runs": rates, "median": medians}


def table(rows: list[dict]) -> str:
    lines = [
        "| tp | precision | checkpointing | positions planned | predicted GiB | measured GiB "
        "| predicted ÷ measured | within 20 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        verdict = "**PASS**" if abs(row["ratio"] - 1) <= TOLERANCE else "MISS"
        lines.append(
            f"| {row['tp']} | {row['precision']} | {row['checkpointing']} "
            f"| {row['batch_positions']} | {row['predicted_gib']:.3f} "
            f"| {row['measured_gib']:.3f} | {row['ratio']:.3f} "
            f"| {verdict} |"
        )
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="tp:precision:checkpointing,... (default: all 8)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--malloc", choices=sorted(MALLOC), default="recipe")
    parser.add_argument("--data", choices=("long", "embedded"), default="long")
    parser.add_argument("--speed", type=int, metavar="N", help="N speed runs per allocator")
    args = parser.parse_args()
    malloc = MALLOC[args.malloc]
    configs = CONFIGS
    if args.only:
        wanted = [item.split(":") for item in args.only.split(",")]
        configs = [(int(tp), precision, mode) for tp, precision, mode in wanted]
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average: {_load()}; "
        f"malloc: {args.malloc} {malloc}; data: {args.data}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory_model_") as temporary:
        folder = Path(temporary)
        write_records(folder / "records.jsonl")
        data = folder / "records.jsonl" if args.data == "long" else None
        for config in configs if args.speed else []:
            result = speed(folder, data, config, args.steps, args.speed, args.malloc)
            chosen, glibc = result["median"][args.malloc], result["median"]["glibc"]
            print(
                f"  {config}: tokens/s {args.malloc} {chosen:.0f} glibc {glibc:.0f}, ratio "
                f"{chosen / glibc:.3f} (runs {result['runs']}), load {_load()}",
                flush=True,
            )
        if args.speed:
            return
        for config in configs:
            rows.append(measure(folder, data, config, args.steps, malloc))
            row = rows[-1]
            print(
                f"  {config}: predicted {row['predicted_gib']:.3f} measured "
                f"{row['measured_gib']:.3f} (per step {row['peaks_per_step']}), "
                f"{row['run_s']:.0f} s, load {_load()}",
                flush=True,
            )
    print(table(rows))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average: {_load()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    misses = sum(abs(row["ratio"] - 1) > TOLERANCE for row in rows)
    print(f"{len(rows) - misses} of {len(rows)} within {TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
