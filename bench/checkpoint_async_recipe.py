"""The recipe's own steps while an async save is written, against its steps without one (issue 24's
goal: <= 1.15x), at a model shape given as overrides; the same steps of a sync run beside them.

Why: bench/checkpoint_async.py measures the writer on a plain MLP over gloo; this one measures what
a user sees, the recipe's ``tokens_per_s``, on whatever device the recipe picks (CUDA on a GPU
machine: bench/gpu_check.sh runs it at a ~1B Llama shape).

Each repetition runs ``recipes/finetune.py`` twice, ``checkpoint.async=true`` and ``false`` in
alternating order, saving every ``--every`` steps (keep 1, no export). A step's time is ``tokens /
tokens_per_s`` of its metrics line. Steps right after a save (``k * every + 1``) are the steps
"after a save": with async that save is being written meanwhile; with sync it blocked between the
steps, outside them (the control). The other steps after the first two are the steps "without".
Medians over all repetitions; the load average at the start and the end (the machine may be shared).
Run: ``python bench/checkpoint_async_recipe.py --steps 14 --every 4 -- tp=2``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_seconds(metrics: Path) -> dict[int, float]:
    """Each step's time from a run's metrics.jsonl."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {line["step"]: line["tokens"] / line["tokens_per_s"] for line in lines}


def run_once(asynchronous: bool, args, overrides: list[str], folder: Path) -> dict[int, float]:
    command = [
        *(sys.executable, "recipes/finetune.py", *overrides, f"train.max_steps={args.steps}"),
        *(f"checkpoint.every_steps={args.every}", f"checkpoint.async={str(asynchronous).lower()}"),
        *("checkpoint.keep=1", "checkpoint.export=false", "train.val_every=0"),
        f"output_dir={folder}",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr[-3000:]}")
    times = step_seconds(folder / "metrics.jsonl")
    shutil.rmtree(folder, ignore_errors=True)  # a ~1B checkpoint is ~12 GB: one run's at a time
    return times


def split(times: dict[int, float], every: int) -> tuple[list[float], list[float]]:
    """(steps right after a save, the other steps after the first two)."""
    after = [t for step, t in times.items() if step > 2 and (step - 1) % every == 0]
    without = [t for step, t in times.items() if step > 2 and (step - 1) % every != 0]
    return after, without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (the model shape, tp, ...)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    print(f"overrides: {' '.join(args.overrides) or '(none)'}; {args.steps} steps, save every "
          f"{args.every}, {args.reps} repetitions")  # fmt: skip
    found: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    with tempfile.TemporaryDirectory(prefix="checkpoint-async-recipe-") as root:
        for rep in range(args.reps):
            for asynchronous in (True, False) if rep % 2 == 0 else (False, True):
                folder = Path(root, f"{'async' if asynchronous else 'sync'}_{rep}")
                times = run_once(asynchronous, args, args.overrides, folder)
                after, without = split(times, args.every)
                found[asynchronous][0].extend(after)
                found[asynchronous][1].extend(without)
    print("| run | step after a save, ms (n) | step without, ms (n) | ratio |")
    print("|---|---|---|---|")
    for asynchronous in (True, False):
        after, without = found[asynchronous]
        a, w = statistics.median(after), statistics.median(without)
        name = "async (save in flight)" if asynchronous else "sync (control)"
        print(f"| {name} | {a * 1e3:.1f} ({len(after)}) | {w * 1e3:.1f} ({len(without)}) | "
              f"{a / w:.2f} |")  # fmt: skip
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
