"""Run every benchmark of ``bench/`` in turn, print their tables, then every goal line (PASS/MISS)
together.

Why: one command (``make bench``) that reproduces ``BENCHMARKS.md`` on any machine; on 2 CPU cores
it takes a few minutes. Each script also runs alone (``.venv/bin/python bench/<name>.py``).
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
import moe_dispatch  # noqa: E402
import recipe_overhead  # noqa: E402
import replica_sync  # noqa: E402
import tp_comm  # noqa: E402


def main() -> None:
    started = time.perf_counter()
    print(
        f"# shardtune benchmarks, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} CPU "
        "cores, "
        f"{platform.machine()}, torch {torch.__version__}, gloo; load average before: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n",
        flush=True,
    )
    goals: list[str] = []
    sections = (
        ("replica_sync", replica_sync.run),
        ("replica_sync overlap", replica_sync.run_overlap),
        ("recipe_overhead", recipe_overhead.run),
        ("memory", memory.run),
        ("tp_comm", tp_comm.run),
        ("moe_dispatch", moe_dispatch.run),
    )
    for name, run in sections:
        section = time.perf_counter()
        goals += run()
        print(f"\n({name}: {time.perf_counter() - section:.0f} s)\n", flush=True)
    print("### Goals\n")
    print("\n".join(goals))
    print(
        f"\nTotal {time.perf_counter() - started:.0f} s; load average after: "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
