"""A training step's host reads, collectives and CPU time: this checkout against another (before).

    .venv/bin/python bench/step_syncs.py --before PATH [--rounds 3] [--steps 12] [OVERRIDE ...]

PATH is a checkout of the code to compare with (``git worktree add --detach PATH REF``); both run
with this venv, each from its own folder. The recipe at tp=2 dp=2 (the tiny Llama of
``tests/e2e/test_profiler.py``, 8 sequences a step in micro-batches of 4, AdamW, fp32), with any
recipe overrides given after the options (``sp=true``, ``model=qwen3_moe``) for both checkouts:

- reads: step 2 profiled (``profile.steps=[2,2]``) with that test's ``sitecustomize.py``, which
  logs every read of a tensor's value on the host made from ``components/`` or ``recipes/``; per
  rank. From rank 0's trace: ``aten::_local_scalar_dense`` in the step (all, and outside the
  optimizer's step) and the collectives the backend ran (``gloo:*`` events).
- time: ``--rounds`` rounds, the checkouts alternated within each, ``--steps`` steps a run; a
  run's figure is the median step time (``tokens / tokens_per_s``) over steps 3 on; the ratio is
  of the medians over rounds. CPU step time is load-sensitive: the load average is printed.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.test_profiler import COMMON, READS_LOGGED  # noqa: E402  (the test's own method)

LAYOUT = ["tp=2", "dp=2", "train.micro_batch_size=4"]
OVERRIDES: list[str] = []  # the command line's, after the options


def _recipe(checkout: Path, output: Path, extra: list[str], environment: dict) -> list[dict]:
    arguments = [*COMMON, *LAYOUT, *OVERRIDES, *extra, f"output_dir={output}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment}
    paths = [environment.get("PYTHONPATH"), str(checkout)]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    command = [sys.executable, "recipes/finetune.py", *arguments]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{checkout}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def counts(checkout: Path, work: Path) -> dict:
    """Step 2's reads per rank (ours), trace syncs and backend collectives on rank 0."""
    site, log = work / "site", work / "reads.log"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(READS_LOGGED)
    environment = {"PYTHONPATH": str(site), "COUNT_REPO": str(checkout), "COUNT_LOG": str(log)}
    extra = ["train.max_steps=2", "profile.steps=[2,2]"]
    _recipe(checkout, work / "run", extra, environment)
    lines = [line.split() for line in log.read_text().splitlines()]
    reads = sorted(sum(line[:2] == [pid, "1"] for line in lines) for pid in {x[0] for x in lines})
    events = json.loads((work / "run/profile/rank0.pt.trace.json").read_text())["traceEvents"]
    (span,) = [e for e in events if e.get("name") == "ProfilerStep#2"]
    inside = [e for e in events if "ts" in e and 0 <= e["ts"] - span["ts"] <= span["dur"]]
    optimizer = [e for e in inside if str(e.get("name", "")).startswith("Optimizer.step")]

    def in_optimizer(event: dict) -> bool:
        return any(0 <= event["ts"] - o["ts"] <= o["dur"] for o in optimizer)

    syncs = [e for e in inside if e.get("name") == "aten::_local_scalar_dense"]
    names = [e.get("name", "") for e in inside]
    backend = collections.Counter(name for name in names if name.startswith("gloo:"))
    return dict(
        reads=reads,
        syncs=len(syncs),
        syncs_outside_optimizer=sum(not in_optimizer(e) for e in syncs),
        collectives=sum(backend.values()),
        by_kind=dict(sorted(backend.items())),
    )


def step_seconds(checkout: Path, output: Path, steps: int) -> float:
    records = _recipe(checkout, output, [f"train.max_steps={steps}"], {})
    return statistics.median(r["tokens"] / r["tokens_per_s"] for r in records[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both checkouts")
    options = parser.parse_args()
    OVERRIDES.extend(options.overrides)
    checkouts = {"before": options.before.resolve(), "after": REPO}
    print(f"overrides: {' '.join(LAYOUT + OVERRIDES)}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        for name, checkout in checkouts.items():
            print(name, json.dumps(counts(checkout, Path(folder, f"counts-{name}"))))
        times = {name: [] for name in checkouts}
        for round_ in range(options.rounds):
            order = list(checkouts) if round_ % 2 == 0 else list(reversed(checkouts))
            for name in order:
                output = Path(folder, f"time-{name}-{round_}")
                times[name].append(step_seconds(checkouts[name], output, options.steps))
        for name, seconds in times.items():
            print(f"{name}: step s per round {[round(s, 4) for s in seconds]}")
        before, after = (statistics.median(times[name]) for name in ("before", "after"))
        print(f"after / before step time: {after / before:.3f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
