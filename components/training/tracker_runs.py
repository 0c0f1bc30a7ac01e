"""Which tracker run an output folder's run logs to, so that a resumed run continues it.

``<output_dir>/tracker_runs.json`` maps a tracker (``mlflow``, ``wandb``) to its run's id and
where that run lives (an MLflow tracking URI and experiment, a W&B project and entity). The logger
of a fresh run records its new tracker run there; the logger of a resumed one (``first_step`` > 0)
continues the recorded run when it lives where this run logs. Only the rank that logs writes the
file, whole or not at all (a private copy renamed over it), so a kill leaves the old file or the
new one.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRACKER_RUNS_FILE = "tracker_runs.json"


def recorded_runs(output_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every tracker's recorded run; nothing for a missing or unreadable file."""
    try:
        found = json.loads((Path(output_dir) / TRACKER_RUNS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {
        name: entry
        for name, entry in (found.items() if isinstance(found, dict) else ())
        if isinstance(entry, dict) and isinstance(entry.get("run_id"), str)
    }


def continued_run(
    output_dir: str | Path, tracker: str, first_step: int, where: Mapping[str, Any]
) -> str | None:
    """The id of the run ``tracker`` recorded in ``output_dir``, for a resumed run
    (``first_step`` > 0) that logs to the same place (``where`` equals the recorded fields); None
    for a fresh run, a run recorded elsewhere, or none."""
    entry = recorded_runs(output_dir).get(tracker)
    if first_step <= 0 or entry is None:
        return None
    if any(entry.get(key) != value for key, value in where.items()):
        return None
    return entry["run_id"]


def record_run(output_dir: str | Path, tracker: str, run_id: str, where: Mapping[str, Any]) -> None:
    """Record ``run_id`` (living at ``where``) as ``tracker``'s run of ``output_dir``; the other
    trackers' entries stay."""
    runs = recorded_runs(output_dir) | {tracker: {"run_id": run_id, **where}}
    path = Path(output_dir) / TRACKER_RUNS_FILE
    private = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    private.write_text(json.dumps(runs, indent=1, sort_keys=True))
    os.replace(private, path)


def records_between(metrics_path: Path, after: int, up_to: int) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` at steps after ``after`` up to ``up_to``, in file order:
    what a resumed run gives a tracker again (a killed attempt's last line may be cut: skipped)."""
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and after < step <= up_to:
            records.append(record)
    return records
