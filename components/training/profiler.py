"""The profiler on request (``profile.steps=[FIRST, LAST]``, 1-based like the metrics' ``step``):
a torch.profiler trace per rank of those steps, and with ``profile.memory=true`` on CUDA a memory
snapshot of them; the train loop steps it once per step and closes it. Also the checks of the
``profile`` keys and the count of host syncs per profiled step read back from a trace.

Each rank writes ``output_dir/profile/rank{R}.pt.trace.json``: Chrome trace JSON (Perfetto and
chrome://tracing open it) named as the TensorBoard profiler plugin's files are (worker ``rank{R}``,
run ``profile`` under ``tensorboard --logdir output_dir``); ``rank{R}.memory.pickle`` opens in
https://pytorch.org/memory_viz. Each profiled step is a ``ProfilerStep#N`` range (N = the
metrics' step), the span the TensorBoard plugin's step view reads. See docs/profiling.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HOST_SYNC = "aten::_local_scalar_dense"  # what item(), bool(), float() of a tensor run
STEP_RANGE = "ProfilerStep#"
OPTIMIZER_STEP = "Optimizer.step#"  # the range torch.optim puts around each optimizer's step
MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept for the snapshot (torch's own example)


def profile_errors(
    steps: list[int] | None, memory: bool, last_step: int, device_type: str
) -> list[str]:
    """What is wrong with ``profile.steps`` (1-based [FIRST, LAST] within the run's ``last_step``
    steps) and ``profile.memory`` (a CUDA snapshot of the profiled steps), each a sentence saying
    what would work."""
    if memory and device_type != "cuda":
        cuda_only = "profile.memory=true is a CUDA memory snapshot: not supported on the CPU"
        return [f"{cuda_only}; remove it"]
    if steps is None:
        if memory:
            return ["profile.memory=true snapshots the profiled steps: give profile.steps=[2,3]"]
        return []
    first, last = steps
    shown = f"profile.steps=[{first},{last}]"
    if first > last:
        return [
            f"{shown} is not a range: use [FIRST, LAST] with FIRST <= LAST, e.g. [{last},{first}]"
        ]
    if last > last_step:
        return [
            f"{shown} goes past the run's last step ({last_step}): use steps within 1..{last_step}"
        ]
    return []


class StepProfiler:
    """torch.profiler over steps ``first``..``last`` (1-based) of this run; inert without them.
    ``step(done)`` after each step begins or ends the profile; ``close()`` after the loop writes
    what a run stopped early recorded."""

    def __init__(
        self, steps: list[int] | None, memory: bool, output_dir: Path, rank: int, done: int
    ) -> None:
        self.first, self.last = steps if steps is not None else (0, -1)
        self.memory, self.folder, self.rank = memory, output_dir / "profile", rank
        self._profile: torch.profiler.profile | None = None
        self._range: torch.profiler.record_function | None = None
        self._begin(done + 1)  # ``done``: the steps done before this invocation (a resume's)

    def step(self, done: int) -> None:
        """Step ``done`` (1-based) is over: close its range, then begin, go on or finish."""
        if self._profile is None:
            self._begin(done + 1)
            return
        self._range.__exit__(None, None, None)
        if done >= self.last:
            self._finish()
        else:
            self._enter_step(done + 1)

    def close(self) -> None:
        """Write the trace of a profile still running (a run that stopped before ``last``)."""
        if self._profile is not None:
            self._range.__exit__(None, None, None)
            self._finish()

    def _begin(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
        if self.memory:  # the checks allow it on CUDA only
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=True, profile_memory=self.memory
        )
        self._profile.__enter__()
        self._enter_step(step)

    def _enter_step(self, step: int) -> None:
        self._range = torch.profiler.record_function(f"{STEP_RANGE}{step}")
        self._range.__enter__()

    def _finish(self) -> None:
        self._profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.folder / f"rank{self.rank}.pt.trace.json"))
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profile, self._range, self.last = None, None, -1  # done: never begins again


def host_syncs_per_step(trace: Path, apart: str | None = None) -> dict[int, int]:
    """Per profiled step (1-based, from its ``ProfilerStep#N`` range): how many times the host
    waited for a tensor's value (``aten::_local_scalar_dense`` calls inside the range); with
    ``apart``, those inside ranges whose name starts with it not counted (``OPTIMIZER_STEP``:
    torch's optimizers read their step counters, CPU tensors unless ``capturable``, so no device
    wait)."""
    events = json.loads(trace.read_text())["traceEvents"]

    def spans(prefix: str) -> list[tuple[str, float, float]]:
        return [
            (event["name"], event["ts"], event["ts"] + event["dur"])
            for event in events
            if event.get("cat") == "user_annotation" and event["name"].startswith(prefix)
        ]

    skipped = spans(apart) if apart else []
    syncs = [
        event["ts"]
        for event in events
        if event.get("name") == HOST_SYNC
        and not any(start <= event["ts"] <= end for _, start, end in skipped)
    ]
    return {
        int(name[len(STEP_RANGE) :]): sum(start <= ts <= end for ts in syncs)
        for name, start, end in spans(STEP_RANGE)
    }
