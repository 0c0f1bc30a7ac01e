"""Launch to first batch, and peak RSS per rank, with the data prepared once and cached (issue 14).

Why: before, every rank read and tokenized every record at every start (linear in the data, per
rank, per run). Now the launcher tokenizes once into an Arrow cache and the ranks memory-map it; a
second experiment on the same data (another output folder, so its own tokenizer folder) reuses the
cache.

Each experiment is a fresh interpreter (imports included), doing what the launcher and ranks do with
the data: train the tiny tokenizer on the capped text of the generated records, ``prepare_data``
(``num_proc`` = the CPU's cores), then fork 2 dp ranks that each ``StepBatches.open`` the train
split and build the micro-batches of step 0. Measured: wall time from the driver's start of the
interpreter to the moment the slowest rank holds its first batch, and each rank's peak RSS
(``VmHWM``, which counts the pages a forked rank shares with its launcher, as ``ps`` does). Sizes:
2k, 20k, 200k, 1M short generated records, each in a fresh cache (first run), then again with a new
tokenizer folder (second experiment).

    .venv/bin/python bench/data_loading.py [sizes...]
"""

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (2_000, 20_000, 200_000, 1_000_000)
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, DP = 48, 16, 8, 2


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rank(split, dp_rank: int, queue) -> None:
    from components.data.loader import StepBatches

    data = StepBatches.open(split, GLOBAL_BATCH, MICRO_BATCH, dp_size=DP, dp_rank=dp_rank, seed=0)
    batches = data.batches_for_step(0)
    queue.put(
        {
            "at": time.time(),
            "rss": _peak_rss_mib(),
            "tokens": data.tokens_in_step(0),
            "rows": len(batches),
        }
    )


def child(size: int, cache_root: str, tokenizer_dir: str) -> None:
    """One experiment: tokenizer, prepare_data, 2 forked ranks to their first batch; print a JSON
    line."""
    from components.data.prepare import prepare_data, source_cache_dir
    from components.data.sources import GeneratedSource
    from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer

    imported = time.time()
    source = GeneratedSource(num_examples=size, val_fraction=0.02, seed=0)
    train_tokenizer(source.texts(source_cache_dir(cache_root)), DEFAULT_VOCAB_SIZE, tokenizer_dir)
    cores = os.cpu_count() or 1
    prepared = prepare_data(
        source,
        tokenizer_dir,
        seq_len=SEQ_LEN,
        loss_on="all_assistant",
        packing=False,
        seed=0,
        cache_root=cache_root,
        num_proc=cores,
    )
    ready = time.time()
    launcher_rss = _peak_rss_mib()
    context = mp.get_context("fork")  # as components.runtime.launch.launch_local starts ranks
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(prepared.train, r, queue)) for r in range(DP)]
    for process in ranks:
        process.start()
    reports = [queue.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join()
    result = {
        "imported": imported,
        "prepared_s": ready - imported,
        "first_batch": max(r["at"] for r in reports),
        "rank_rss": max(r["rss"] for r in reports),
        "launcher_rss": launcher_rss,
        "reused": prepared.reused,
    }
    print(json.dumps(result), flush=True)


def experiment(size: int, cache_root: Path, tokenizer_dir: Path) -> dict:
    started = time.time()
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(size), str(cache_root), str(tokenizer_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["launch_to_first_batch_s"] = result["first_batch"] - started
    result["imports_s"] = result["imported"] - started
    return result


def run(sizes: tuple[int, ...] = SIZES) -> list[str]:
    """Print the table; return the goal lines (PASS/MISS)."""
    rows, results = [], {}
    root = Path(tempfile.mkdtemp(prefix="shardtune-bench-data-"))
    try:
        for size in sizes:
            cache = root / f"cache-{size}"
            first = experiment(size, cache, root / f"tok-{size}-a")
            second = experiment(size, cache, root / f"tok-{size}-b")
            assert not first["reused"] and second["reused"]
            results[size] = (first, second)
            for name, r in (("first run", first), ("second experiment", second)):
                rows.append(
                    f"| {size:,} | {name} | {r['launch_to_first_batch_s']:.1f} | "
                    f"{r['imports_s']:.1f} "
                    f"| {r['prepared_s']:.1f} | {r['rank_rss']:.0f} | {r['launcher_rss']:.0f} |"
                )
            print(rows[-2] + "\n" + rows[-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        "### Data: launch to first batch and peak RSS per rank (2 dp ranks, seq_len 48, cores = "
        f"{os.cpu_count()})",
        "",
        "| records | experiment | launch → first batch s | of which imports s | tokenizer + "
        "prepare_data s "
        "| peak RSS per rank MiB | launcher peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    goals = []
    if sizes[0] == SIZES[0]:
        base_time, base_rss = (
            results[sizes[0]][0]["launch_to_first_batch_s"],
            results[sizes[0]][0]["rank_rss"],
        )
        worst = max(results[s][1]["launch_to_first_batch_s"] for s in sizes)
        verdict = "PASS" if worst <= 1.5 * base_time + 5 else "MISS"
        goals.append(
            f"{verdict} data second experiment: slowest {worst:.1f} s (goal ≤ 1.5 × "
            f"{base_time:.1f} s + 5 s, "
            "the 2k first run)"
        )
        top = results[sizes[-1]]
        rss = max(top[0]["rank_rss"], top[1]["rank_rss"]) / base_rss
        verdict = "PASS" if rss <= 1.3 else "MISS"
        goals.append(
            f"{verdict} data peak RSS per rank at {sizes[-1]:,}: {rss:.2f}× the 2k run (goal ≤ "
            "1.3×)"
        )
    print("\n".join(goals))
    return goals


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        run(tuple(int(arg) for arg in sys.argv[1:]) or SIZES)
