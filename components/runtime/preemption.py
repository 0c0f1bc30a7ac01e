"""Preemption: SIGTERM or SIGUSR1 (what Slurm's ``--signal`` sends) asks a run to stop after its
step.

Every rank calls :func:`install` before its first step. The first such signal only records the
request (:func:`stop_requested`); the training loop all-reduces it once per step (MAX over the
ranks: a signal to one rank stops every rank after the same step), checkpoints that step and ends.
A second signal ends the process at once (the default action, re-sent).

The recipe's own launcher (:func:`components.runtime.launch.launch_local`) installs it with
``forward_to``: it passes the first signal on to its ranks and waits for them; a second SIGKILLs
them and raises torch elastic's ``SignalException`` in the launcher. A rank forked from it inherits
the handler and only records, leaving a repeated signal to its launcher: a signal to the whole
process group (``timeout``, ``kill -- -PGID``, Slurm signalling every process of a job step)
reaches it twice, directly and passed on, as one request.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException

from components.runtime.console import print_line

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The signals torch elastic's launcher turns into SignalException itself
# (LaunchConfig.signals_to_handle, torchrun's --signals-to-handle): SIGTERM is left out so that the
# recipe's launcher forwards it and waits.
ELASTIC_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"

_requested: list[signal.Signals] = []  # the signals received, in order (this process)
_forward: dict[
    int, Callable[[], Iterable[int]]
] = {}  # installing pid -> the pids to pass signals to


def _handle(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    forward = _forward.get(os.getpid())
    if forward is not None:  # a launcher: the second signal ends its ranks at once
        passed = signal.SIGKILL if _requested else signum
        for pid in forward():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, passed)
    if _requested:  # the second signal: end now
        if forward is not None:
            raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
        if os.getppid() in _forward:  # a rank of a launcher that passes signals on (see above)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _requested.append(sigval)
    if forward is not None:
        note = f"note: {sigval.name}: the ranks finish their step and write a checkpoint of it"
        print_line(f"{note} (a second signal stops at once)", sys.stderr)


def install(forward_to: Callable[[], Iterable[int]] | None = None) -> None:
    """Handle SIGTERM and SIGUSR1 in this process (main thread only): the first records a stop
    request, the second ends the process. ``forward_to``: the pids each signal is passed on to (a
    launcher's ranks); with it, the second signal raises ``SignalException`` instead of ending this
    process."""
    if forward_to is not None:
        _forward[os.getpid()] = forward_to
    for sigval in SIGNALS:
        signal.signal(sigval, _handle)


def stop_requested() -> signal.Signals | None:
    """The first stop signal this process received, or None."""
    return _requested[0] if _requested else None
