"""This process and its neighbours on the host: die with the parent, whether a pid exists and
whether it is alive.
Below every layer: a rank's launcher and the data preparation's workers both use them."""

import ctypes
import os
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; a
    no-op elsewhere). ``parent_pid``: the parent expected; if it has already died (so this process
    was re-parented before the call), exit at once. Without it, a parent of pid 1 counts as dead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    parent_gone = os.getppid() == 1 if parent_pid is None else os.getppid() != parent_pid
    if parent_gone:
        os._exit(1)


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host and has not ended: a zombie (ended, not yet
    reaped by its parent; Linux's ``/proc`` tells) counts as ended."""
    if not process_exists(pid):
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:  # no /proc here (alive, as far as can be told), or it was reaped just now
        return process_exists(pid)
    return fields[:1] != ["Z"]
