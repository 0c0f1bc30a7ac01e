"""What a hung process tree is doing, for a test's failure report: every Python thread's stack
(with native frames) of a process and all its descendants, by ``py-spy dump`` (a test
dependency). A hang then names its own cause in CI's log instead of only a timeout."""

import shutil
import subprocess
import sys
from pathlib import Path

PROC = Path("/proc")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop(0)
        found.append(current)
        frontier += sorted(children.get(current, []))
    return found


def python_stacks(pids: list[int], timeout_s: float = 30) -> str:
    """The stacks of ``pids`` as one text (a process py-spy cannot read says why)."""
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        return "(no stacks: py-spy is not installed)"
    parts = []
    for pid in pids:
        try:
            dump = subprocess.run(
                [py_spy, "dump", "--native", "--pid", str(pid)],
                capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
            text = dump.stdout or dump.stderr
        except subprocess.TimeoutExpired:
            text = "(py-spy timed out)"
        parts.append(f"--- stacks of pid {pid}:\n{text.rstrip()}")
    return "\n".join(parts)
