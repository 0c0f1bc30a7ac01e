"""One summary line of bench/gpu_check.sh for one recipe run: the median ``tokens_per_s``,
``tflops`` and ``mfu`` of its steps after the warm-up, its peak memory against the dry run's plan
of the same settings, and the largest value of any save-timing key the metrics carry.

Why: the throughput figures of a lent GPU come back as a few lines and one JSON record per run
(appended to RECORDS), not as folders of metrics.
Run: ``python bench/gpu_run_line.py LABEL METRICS PLAN WARMUP RECORDS``.
"""

import json
import statistics
import sys
from pathlib import Path


def median(lines: list[dict], key: str) -> float | None:
    values = [line[key] for line in lines if line.get(key) is not None]
    return statistics.median(values) if values else None


def record(label: str, metrics: Path, plan: Path, warmup: int) -> dict:
    """The run's figures (None where a metric or the plan is missing)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    measured = lines[warmup:] or lines
    planned = json.loads(plan.read_text()) if plan.is_file() else {}
    peak = max((line.get("peak_memory_gib") or 0.0) for line in lines)
    total = planned.get("per_rank_gib", {}).get("total")
    saves = {key for line in lines for key in line if "save" in key}
    return {
        "run": label,
        "steps": len(lines),
        "first_loss": lines[0].get("loss") if lines else None,
        "last_loss": lines[-1].get("loss") if lines else None,
        "measured_steps": len(measured),
        "tokens_per_step": median(measured, "tokens"),
        "tokens_per_s": median(measured, "tokens_per_s"),
        "tflops": median(measured, "tflops"),
        "mfu": median(measured, "mfu"),
        "peak_memory_gib": peak,
        "planned_gib": total,
        "params_gib": planned.get("per_rank_gib", {}).get("params"),
        "flops_per_token": planned.get("flops_per_token"),
        **{key: max(line.get(key) or 0.0 for line in lines) for key in sorted(saves)},
    }


def shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def line(found: dict) -> str:
    ratio = found["peak_memory_gib"] / found["planned_gib"] if found["planned_gib"] else None
    saves = "".join(f", {k} {v:.2f}" for k, v in found.items() if "save" in k)
    return (
        f"line  {found['run']}: {shown(found['tokens_per_s'], '.0f')} tokens/s, "
        f"{shown(found['tflops'], '.1f')} TFLOP/s, MFU {shown(found['mfu'], '.3f')}, "
        f"peak {found['peak_memory_gib']:.2f} GiB / planned {shown(found['planned_gib'], '.2f')}"
        f" ({shown(ratio, '.2f')}){saves}; {shown(found['tokens_per_step'], '.0f')} tokens/step, "
        f"median of {found['measured_steps']} of {found['steps']} steps, loss "
        f"{shown(found['first_loss'], '.3f')} -> {shown(found['last_loss'], '.3f')}"
    )


def main() -> int:
    label, metrics, plan, warmup, records = sys.argv[1:]
    if not Path(metrics).is_file():
        print(f"line  {label}: no metrics ({metrics})")
        return 1
    found = record(label, Path(metrics), Path(plan), int(warmup))
    with open(records, "a") as file:
        file.write(json.dumps(found) + "\n")
    print(line(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
