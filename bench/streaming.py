"""Streaming (``data.streaming=true``, issue 48): time to the first step does not grow with the set.

Why: the cached path tokenizes the whole source before any rank starts (minutes for hundreds of
MB); a streamed source is read as the steps need it, so a set twice the size should start as fast.

Generated here, in a temporary folder (never committed): Parquet sets of about 100 MB and 200 MB
(shards of 25,000 records of 60 random words, snappy-compressed as pyarrow writes them). Each is
trained on by ``recipes/finetune.py`` as a user runs it (``data=hf data.streaming=true``, the tiny
default Llama, dp=1, packed rows of 512 tokens, one step, a fresh ``cache_dir`` per run so each
trains its tokenizer on the stream's first texts). Measured: wall time from starting the command
to its first line of ``metrics.jsonl`` (step 1 done), and the CPU seconds its processes had spent
by then (less sensitive to other work on the machine). The sizes are alternated for ``--rounds``
rounds; the figures are the ratios of the medians, 200 MB over 100 MB (goal: at most 1.2).

    .venv/bin/python bench/streaming.py [--rounds 3]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SIZES_MB = (100, 200)
RECORDS_PER_SHARD = 25_000
GOAL = 1.2


def write_set(folder: Path, megabytes: int, seed: int) -> int:
    """Parquet shards of random-word records in ``folder`` until they hold ``megabytes``; returns
    the records written."""
    folder.mkdir(parents=True)
    random = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(random.choice(letters, size=random.integers(2, 9))) for _ in range(20_000)]
    written, shard = 0, 0
    while sum(p.stat().st_size for p in folder.iterdir()) < megabytes * 1_000_000:
        picks = random.integers(0, len(words), size=(RECORDS_PER_SHARD, 60))
        prompts = [" ".join(words[i] for i in row[:20]) for row in picks]
        responses = [" ".join(words[i] for i in row[20:]) for row in picks]
        table = pa.table({"prompt": prompts, "response": responses})
        pq.write_table(table, folder / f"part-{shard:05d}.parquet")
        written, shard = written + RECORDS_PER_SHARD, shard + 1
    return written


def cpu_s(process: psutil.Process) -> float:
    """CPU seconds (user + system) of ``process`` and its descendants, the reaped ones included."""
    total = 0.0
    for one in [process, *process.children(recursive=True)]:
        try:
            times = one.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def first_step_s(data: Path, work: Path) -> tuple[float, float]:
    """Seconds from starting the recipe on ``data`` to its first metrics line: wall, and CPU of
    its processes (which the load of other work changes less)."""
    output, cache = work / "run", work / "cache"
    command = [sys.executable, "recipes/finetune.py", "data=hf", f"data.path={data}"]
    command += ["data.streaming=true", "data.val_fraction=0", "train.val_every=0"]
    command += ["train.max_steps=1", "train.seq_len=512", "train.packing=true"]
    command += ["checkpoint.every_steps=0", "checkpoint.export=false"]
    command += [f"output_dir={output}", f"cache_dir={cache}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    process = subprocess.Popen(command, cwd=REPO, env=environment, **quiet)
    metrics = output / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        if process.poll() is not None:
            raise RuntimeError(f"the recipe failed: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    elapsed, cpu = time.perf_counter() - started, cpu_s(psutil.Process(process.pid))
    process.communicate()
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as scratch:
        root = Path(scratch)
        for size in SIZES_MB:
            records = write_set(root / f"set{size}", size, seed=size)
            on_disk = sum(p.stat().st_size for p in (root / f"set{size}").iterdir()) / 1e6
            print(f"set {size} MB: {records:,} records, {on_disk:.0f} MB of Parquet")
        times = {size: [] for size in SIZES_MB}
        for round_ in range(rounds):
            for size in SIZES_MB if round_ % 2 == 0 else reversed(SIZES_MB):
                work = root / f"work-{size}-{round_}"
                times[size].append(first_step_s(root / f"set{size}", work))
                wall, cpu = times[size][-1]
                took = f"first step after {wall:.1f} s ({cpu:.1f} CPU s)"
                print(f"round {round_ + 1}, {size} MB: {took}")
    for kind, index in (("wall", 0), ("CPU", 1)):
        medians = {
            size: statistics.median(v[index] for v in values) for size, values in times.items()
        }
        ratio = medians[200] / medians[100]
        verdict = "PASS" if ratio <= GOAL else "MISS"
        print(
            f"median {kind} s to first step: 100 MB {medians[100]:.1f}, 200 MB {medians[200]:.1f}"
        )
        print(f"{verdict}: {kind} 200 MB / 100 MB = {ratio:.2f} (goal <= {GOAL})")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
