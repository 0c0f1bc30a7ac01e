"""Run every benchmark of ``bench/`` in turn, print their tables, then every goal line (PASS/MISS) together.

Why: one command (``make bench``) that reproduces ``BENCHMARKS.md`` on any machine; on 2 CPU cores it takes
a few minutes. Each script also runs alone (``.venv/bin/python bench/<name>.py``).
"""

import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory  # noqa: E402
import recipe_overhead  # noqa: E402
import replica_sync  # noqa: E402
import tp_comm  # noqa: E402


def main() -> None:
    started = time.perf_counter()
    print(
        f"# shardtune benchmarks, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} CPU cores, "
        f"{platform.machine()}, torch {torch.__version__}, gloo; load average before: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n",
        flush=True,
    )
    goals: list[str] = []
    for module in (replica_sync, recipe_overhead, memory, tp_comm):
        section = time.perf_counter()
        goals += module.run()
        print(f"\n({module.__name__}: {time.perf_counter() - section:.0f} s)\n", flush=True)
    print("### Goals\n")
    print("\n".join(goals))
    print(
        f"\nTotal {time.perf_counter() - started:.0f} s; load average after: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
