"""A Hydra ``--multirun`` sweep: every job runs whatever the one before did, and the sweep ends
with one line per job and the status of its first failure (a signal's, when one stopped it)."""

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from components.runtime.console import print_line
from components.runtime.exit_status import STOPPED_STATUS
from components.runtime.problems import is_rank_zero, say


@dataclass(kw_only=True)
class Sweep:
    """The jobs of one sweep as they end: (number, overrides, exit status)."""

    jobs: list[tuple[int, list[str], int]] = field(default_factory=list)

    def run_job(self, number: int, overrides: list[str], job: Callable[[], None]) -> None:
        """Run one job and note how it ended. Its failure (already said in its own ``error:``
        line) does not stop the sweep, as Hydra's users expect; a signal does, once noted: Ctrl-C
        or a second signal (status 128 + N), or SIGTERM or SIGUSR1 that stopped the job after a
        step with a checkpoint (:data:`STOPPED_STATUS`)."""
        status = 0
        try:
            job()
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
        except Exception as error:  # noqa: BLE001 - any job's failure: said, then the next job
            say(f"error: {type(error).__name__}: {error}", file=sys.stderr)
            status = 1
        self.jobs.append((number, overrides, status))
        if _stopped(status):
            raise SystemExit(status)

    def end(self) -> None:
        """After the sweep: its summary on stderr, and exit with its status when a job failed."""
        if not self.jobs:
            return
        lines, status = sweep_summary(self.jobs)
        if is_rank_zero():
            print_line("\n".join(lines), sys.stderr)
        if status:
            raise SystemExit(status)


def sweep_summary(jobs: list[tuple[int, list[str], int]]) -> tuple[list[str], int]:
    """The lines that end a sweep (one per job: its overrides that differ between jobs, and how it
    ended) and the sweep's exit status: 0 when every job was done, else the first failure's (a
    signal's, when one stopped the sweep)."""
    shared = set.intersection(*(set(overrides) for _, overrides, _ in jobs))
    failed = [status for _, _, status in jobs if status]
    stopped = sum(status == STOPPED_STATUS for status in failed)
    counts = f"{len(failed) - stopped} failed" + (f", {stopped} stopped" if stopped else "")
    lines = [f"sweep: {len(jobs) - len(failed)} of {len(jobs)} jobs done, {counts}"]
    for number, overrides, status in jobs:
        own = " ".join(override for override in overrides if override not in shared) or "-"
        lines.append(f"  job {number} ({own}): {_how(status)}")
    if failed and _stopped(failed[-1]):
        lines.append(
            f"  the sweep was stopped by a signal after job {jobs[-1][0]}: later jobs did not run"
        )
    status = next((code for code in failed if _stopped(code)), failed[0] if failed else 0)
    return lines, status


def _stopped(status: int) -> bool:
    """Whether a job's exit status is a signal's: Ctrl-C or a second signal (128 + N), or a stop
    after a step with a checkpoint (:data:`STOPPED_STATUS`: ``checkpoint.resume=auto`` resumes)."""
    return status == STOPPED_STATUS or status >= 128


def _how(status: int) -> str:
    """How a job ended, for the sweep's summary."""
    if status == 0:
        return "done"
    if status == STOPPED_STATUS:
        return f"stopped with a checkpoint (exit status {status}): resume it with resume=auto"
    return f"failed (exit status {status})"
