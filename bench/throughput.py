"""Tokens/s of one AdamW step of the 0.44B Llama shape (seq_len 1024, batch 1) at tp=1: fp32 vs
bf16-mixed vs bf16, activation checkpointing none vs full, compile off vs on (inductor).

Why: the recompute cost of checkpointing (goal: at most 1.4x the step time of ``none``) and what
bf16 and compile buy on this machine. Each configuration runs ``steps`` steps on a fresh process and
reports its last (the first pays for allocation and, with compile, compilation); configurations
alternate, round after round, so a change of load hits all alike; the load average is printed at the
start and the end. On a CPU without bf16 matrix units bf16 may be slower than fp32: the table says
what it measured.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size  # noqa: E402

SEQ_LEN = 1024
# (label, precision, checkpointing, compile)
CONFIGS = [
    ("fp32", "fp32", "none", False),
    ("bf16-mixed", "bf16-mixed", "none", False),
    ("bf16", "bf16", "none", False),
    ("fp32 + full checkpointing", "fp32", "full", False),
    ("fp32 + compile", "fp32", "none", True),
]


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def run(rounds: int = 1, steps: int = 2, labels: list[str] | None = None) -> list[str]:
    """Measure every configuration ``rounds`` times, alternating; print the table; return the goal
    lines."""
    configs = [c for c in CONFIGS if labels is None or c[0] in labels]
    print(f"load average at start: {_load()}", flush=True)
    times: dict[str, list[float]] = {label: [] for label, *_ in configs}
    for _ in range(rounds):
        for label, precision, checkpointing, compile_blocks in configs:
            ranks = real_size.measure(
                1, precision, checkpointing, compile_blocks, SEQ_LEN, steps, exact_rss=False
            )
            times[label].append(ranks[0]["step_s"][-1])
            print(
                f"  {label}: steps {', '.join(f'{t:.1f}' for t in ranks[0]['step_s'])} s",
                flush=True,
            )
    print(f"load average at end: {_load()}\n", flush=True)
    base = min(times["fp32"]) if "fp32" in times else None
    lines = [
        "| configuration | step s (best of rounds) | tokens/s | × fp32 step time |",
        "|---|---|---|---|",
    ]
    for label, measured in times.items():
        best = min(measured)
        ratio = f"{best / base:.2f}" if base else "-"
        lines.append(f"| {label} | {best:.1f} | {SEQ_LEN / best:.1f} | {ratio} |")
    print("\n".join(lines), flush=True)
    goals = []
    if base and "fp32 + full checkpointing" in times:
        ratio = min(times["fp32 + full checkpointing"]) / base
        verdict = "PASS" if ratio <= 1.4 else "MISS"
        goals.append(f"{verdict} full checkpointing step time {ratio:.2f}x none (goal <= 1.4x)")
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default="", help="comma list of configuration labels")
    arguments = parser.parse_args()
    started = time.perf_counter()
    labels = [label.strip() for label in arguments.only.split(",")] if arguments.only else None
    print("\n".join(run(arguments.rounds, arguments.steps, labels)))
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
