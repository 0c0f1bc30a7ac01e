"""Process start-up: join a world started by torchrun, or start local ranks with PyTorch's launcher
API.

Rank failures under :func:`launch_local`: the other ranks are stopped at once, and the launcher
prints the failed rank's traceback, then one line, ``error: rank 1 failed: ValueError: ...``, and
exits with status 1; a watcher thread makes the report name the cause, not a peer that lost its
connection, and reads the ranks' heartbeats: a rank that makes no progress for ``hang_timeout_s``
is named and killed (:mod:`heartbeat`; under torchrun the ranks watch each other).

Every rank dies with its launcher (:func:`die_with_parent`), so a SIGKILLed launcher leaves no
orphans; torch elastic's log folder lives inside the launch's own temporary folder.

Design notes: docs/design-notes.md
"""

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from components.processes import die_with_parent
from components.runtime import preemption
from components.runtime.console import print_line
from components.runtime.heartbeat import (
    NODE_FOLDER_PREFIX,
    RANKS_FOLDER,
    HangWatch,
    remove_dead_folders,
)
from components.runtime.startup import started_by_launcher

# Loggers that print torch elastic's own multi-line report of a failed worker (replaced by ours).
_NOISY_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
    "torch.distributed.elastic.agent.server.api",  # "Received 2 death signal": ours says it
)
# Errors a rank raises because a peer died: an effect, so a rank that failed otherwise is named
# first.
_PEER_SYMPTOMS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "peer",
    "abort",  # NCCL's communicators aborted by abort_when_a_peer_fails
)
# The file (PEER_FAILED.ATTEMPT) a local launcher writes into its ranks' folder when it sees one
# of that attempt fail (:meth:`RankWatch.poll`); the attempt's other ranks then abort their NCCL
# communicators and end.
PEER_FAILED = "peer_failed"
_WATCH_INTERVAL_S = 0.01
_START_WAIT_S = 120.0
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReportedExit(SystemExit):
    """A rank's exit for a reason every rank found alike (:func:`fail_once`): its ``error:`` line is
    ``message``, printed once, by the launcher for ranks :func:`launch_local` started, else by rank
    0; nothing else is added."""

    def __init__(self, code: int, message: str | None = None) -> None:
        super().__init__(code)
        self.message = message


_LAUNCHER_SAYS = False  # True in a rank launch_local started: its launcher prints fail_once's line


def under_torchrun() -> bool:
    """True in a rank torchrun (or another launcher) started; False in the recipe's own launcher
    and in the ranks :func:`launch_local` started, though torch elastic sets ``RANK`` there too."""
    return started_by_launcher() and not _LAUNCHER_SAYS


def fail_once(message: str) -> NoReturn:
    """Stop every rank for bad input with one ``error: <message>`` line on a fresh line of stderr:
    every rank exits with status 1 (:class:`ReportedExit`), and the line is printed once, by the
    launcher of ranks :func:`launch_local` started (after every rank has ended: a restart, or a
    rank that lost a peer which left first, prints nothing more), else by rank 0 (``RANK``, 0 when
    unset)."""
    if not _LAUNCHER_SAYS and int(os.environ.get("RANK", "0")) == 0:
        print_line(f"error: {message}", sys.stderr)
    raise ReportedExit(1, message)


@contextlib.contextmanager
def failure_named_by_this_rank() -> Iterator[None]:
    """Around a rank torchrun started (no launcher of ours reports for it): an exception prints
    its traceback and, unless it only follows another rank's failure (a lost peer), the line the
    local launcher would print, ``error: rank R failed: ...``; the rank exits with status 1, as
    an uncaught exception would. :func:`fail_once`'s exits and the stop statuses pass."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        text = " ".join(f"{type(error).__name__}: {error}".split())
        failed = RankExit(rank=int(os.environ["RANK"]), error=text, time=time.time())
        traceback.print_exc()
        if not failed.consequence:
            print_line(describe_rank_failure([failed])[0], sys.stderr)
        raise SystemExit(1) from None


@dataclass(frozen=True, kw_only=True)
class RankExit:
    """How one rank ended: its error (one line), when (``time.time()``), and its traceback if it
    raised."""

    rank: int
    error: str
    time: float
    traceback: str | None = None
    reported: bool = False  # the rank ended through :func:`fail_once`
    message: str | None = None  # that ``error:`` line's message
    hang: bool = False  # the launcher found it made no progress (``error`` says how long, where)
    ended: bool = False  # the launcher SIGKILLed it after another rank hung

    @property
    def stopped(self) -> bool:
        """True when the launcher stopped this rank (SIGTERM, which torch elastic's handler turns
        into a SignalException in the rank) after another had failed."""
        return self.error.startswith(("killed by SIGTERM", "SignalException:"))

    @property
    def consequence(self) -> bool:
        """True when this failure is most likely caused by another: a lost peer, or the launcher's
        SIGTERM."""
        if self.hang:
            return False
        if self.ended or self.stopped:
            return True
        return any(word in self.error.lower() for word in _PEER_SYMPTOMS)


def write_atomically(path: Path, text: str) -> None:
    private = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    private.write_text(text)
    os.replace(private, path)


def _run_rank(folder: str, launcher_pid: int, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Each rank's entry: die with the launcher, note this rank's pid, run ``entrypoint``, and note
    the exception it raises."""
    global _LAUNCHER_SAYS
    die_with_parent(launcher_pid)
    _LAUNCHER_SAYS = True  # fail_once leaves its line to the launcher (_report_failure)
    tempfile.tempdir = None  # the launcher points it at its own folder (see _temporary_files_in)
    os.environ[RANKS_FOLDER] = folder  # for abort_when_a_peer_fails
    rank = int(os.environ["RANK"])
    Path(folder, f"{rank}.error.json").unlink(missing_ok=True)  # an earlier attempt's (restarts)
    write_atomically(Path(folder, f"{rank}.pid"), str(os.getpid()))
    _wait_until_every_local_rank_started(Path(folder))
    try:
        return entrypoint(*args)
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            text = " ".join(f"{type(error).__name__}: {error}".split())
            record = {"error": text, "time": time.time(), "traceback": traceback.format_exc()}
            record["reported"] = isinstance(error, ReportedExit)
            record["message"] = getattr(error, "message", None)
            write_atomically(Path(folder, f"{rank}.error.json"), json.dumps(record))
        raise


def _wait_until_every_local_rank_started(folder: Path) -> None:
    """Return once every local rank of this attempt has been forked (each notes it with a file).

    Until then no rank may reach the launcher's store: the launcher's store server thread answers a
    connecting rank with a reverse lookup of its address (``getnameinfo``), and a rank forked while
    that thread holds glibc's resolver lock inherits it held and blocks for good in its own first
    lookup (a rank stuck in ``__resolv_context_get`` under ``TCPStore`` while the others wait on
    it). Once every rank exists no fork follows, so the lookups are safe. Gives up waiting after
    ``_START_WAIT_S`` (a rank that died before noting itself fails the launch anyway)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    write_atomically(folder / f"{os.environ['LOCAL_RANK']}.started.{attempt}", "")
    local_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    deadline = time.monotonic() + _START_WAIT_S
    while len(list(folder.glob(f"*.started.{attempt}"))) < local_ranks:
        if time.monotonic() > deadline:
            return
        time.sleep(_WATCH_INTERVAL_S)


def _exit_of(rank: int, pid: int, info: os.waitid_result) -> RankExit | None:
    """A rank's failure from its ``waitid`` result; None when it exited with status 0."""
    if info.si_code == os.CLD_EXITED:
        if info.si_status == 0:
            return None
        error = f"exited with status {info.si_status} (pid {pid})"
        return RankExit(rank=rank, error=error, time=time.time())
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        name = f"signal {info.si_status}"
    return RankExit(rank=rank, error=f"killed by {name} (pid {pid})", time=time.time())


class RankWatch:
    """Records when and how each local rank's process ends, without reaping it (``os.waitid`` with
    ``WNOWAIT``, so torch's own join still works), and collects the exceptions ranks noted."""

    def __init__(self, nproc: int, hang_timeout_s: float | None = None) -> None:
        remove_dead_folders(Path(tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=f"{NODE_FOLDER_PREFIX}{os.getpid()}-"))
        self._nproc = nproc
        self._pids: dict[int, int] = {}  # rank -> pid, as each rank notes it
        self._seen: dict[
            int, RankExit | None
        ] = {}  # rank -> its exit (None: exited 0, or reaped unseen)
        self._stopped: dict[
            int, RankExit
        ] = {}  # rank -> when a signal stopped it (while not continued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._hangs = None if hang_timeout_s is None else HangWatch(self.folder, hang_timeout_s)
        self._next_look, self._hung_attempts = 0.0, set()  # one hang reported per attempt
        self._ended: dict[int, RankExit] = {}  # rank -> its SIGKILL after a hang (not a cause)

    def __enter__(self) -> "RankWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(_WATCH_INTERVAL_S):
            self.poll()

    def poll(self) -> None:
        """Look once at every rank that has started and not been seen to end; note ranks stopped by
        a signal, and once any other rank has ended, kill the stopped ones (they would hold the
        launch up forever)."""
        if len(self._pids) < self._nproc or self._seen:  # a restart starts ranks anew
            self._read_pids()
        for rank, pid in self._pids.items():
            if rank in self._seen:
                continue
            flags = os.WEXITED | os.WSTOPPED | os.WCONTINUED | os.WNOHANG | os.WNOWAIT
            try:
                info = os.waitid(os.P_PID, pid, flags)
            except ChildProcessError:  # already reaped by torch's join: its report covers it
                self._seen[rank] = None
                continue
            if info is None:
                continue
            if info.si_code == os.CLD_STOPPED:
                stop = RankExit(rank=rank, error=_stop_text(pid, info.si_status), time=time.time())
                self._stopped.setdefault(rank, stop)
            elif info.si_code == os.CLD_CONTINUED:
                self._stopped.pop(rank, None)
            else:
                self._seen[rank] = _exit_of(rank, pid, info)
                if self._seen[rank] is not None:  # the survivors' NCCL waits would not end
                    write_atomically(self.folder / f"{PEER_FAILED}.{self._attempt()}", str(rank))
        if (
            self._stopped and self._seen
        ):  # a peer has ended (failed, or already reaped by torch elastic)
            for rank in set(self._stopped) - set(self._seen):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pids[rank], signal.SIGKILL)
        self._look_for_a_hang()

    def _look_for_a_hang(self) -> None:
        """Every beat interval, read the running ranks' heartbeats; on a hang, note it as the
        named rank's error and SIGKILL every rank of the attempt (torch elastic then fails the
        launch, or restarts the world)."""
        if self._hangs is None or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + self._hangs.interval
        attempt = self._attempt()
        running = {rank: pid for rank, pid in self._pids.items() if rank not in self._seen}
        hang = None if attempt in self._hung_attempts else self._hangs.look(str(attempt), running)
        if hang is None:
            return
        self._hung_attempts.add(attempt)
        record = dict(error=hang.text, time=time.time(), traceback=hang.stack, hang=True)
        write_atomically(self.folder / f"{hang.rank}.error.json", json.dumps(record))
        for rank, pid in running.items():  # a rank stuck in a kernel would ignore a SIGTERM
            error = f"killed by SIGKILL (pid {pid}) after rank {hang.rank} hung"
            self._ended[rank] = RankExit(rank=rank, error=error, time=time.time(), ended=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _attempt(self) -> int:
        """The latest attempt whose ranks have started (each notes ``RANK.started.ATTEMPT``)."""
        started = [path.name.rsplit(".", 1)[1] for path in self.folder.glob("*.started.*")]
        return max((int(attempt) for attempt in started if attempt.isdigit()), default=0)

    def _read_pids(self) -> None:
        """Note each rank's pid; a rank whose pid changed (restarted) is watched afresh."""
        for path in self.folder.glob("*.pid"):
            rank, pid = int(path.name.split(".")[0]), int(path.read_text())
            if self._pids.get(rank) != pid:
                self._pids[rank] = pid
                self._seen.pop(rank, None)
                self._stopped.pop(rank, None)

    def pids(self) -> list[int]:
        """The pids of the ranks that have noted theirs (read afresh: safe in a signal handler)."""
        pids = []
        for path in self.folder.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(path.read_text()))
        return pids

    def failures(self) -> list["RankExit"]:
        """Every rank seen to fail or noted an exception; a rank's own note wins over its exit
        status, and a rank seen stopped is reported as stopped (not as the SIGKILL that ended
        it)."""
        self.stop()
        self.poll()
        found = {rank: exit_ for rank, exit_ in self._seen.items() if exit_ is not None}
        found.update(self._stopped)
        for rank, ended in self._ended.items():  # the hang's consequences, however seen
            if rank not in found or found[rank].error.startswith("killed by SIGKILL"):
                found[rank] = ended
        for path in self.folder.glob("*.error.json"):
            record = json.loads(path.read_text())
            rank = int(path.name.split(".")[0])
            found[rank] = RankExit(
                rank=rank,
                error=record["error"],
                time=record["time"],
                traceback=record["traceback"],
                reported=record.get("reported", False),
                message=record.get("message"),
                hang=record.get("hang", False),
            )
        return list(found.values())


def _stop_text(pid: int, signal_number: int) -> str:
    try:
        name = signal.Signals(signal_number).name
    except ValueError:
        name = f"signal {signal_number}"
    return f"stopped by {name} (pid {pid}), so its peers waited on it"


def _from_elastic(error: ChildFailedError) -> list[RankExit]:
    """Torch elastic's record of the failures (usually one rank), for ranks the watch missed."""
    exits = []
    for rank, failure in error.failures.items():
        message = failure.message
        if isinstance(
            message, dict
        ):  # from the rank's error file: {"message": ..., "extraInfo": ...}
            text = " ".join(str(message.get("message", "")).split())
            callstack = message.get("extraInfo", {}).get("py_callstack")
            exits.append(
                RankExit(rank=rank, error=text, time=failure.timestamp, traceback=callstack)
            )
        elif failure.exitcode < 0:
            error = f"killed by {failure.signal_name()} (pid {failure.pid})"
            exits.append(RankExit(rank=rank, error=error, time=failure.timestamp))
        else:
            error = f"exited with status {failure.exitcode} (pid {failure.pid})"
            exits.append(RankExit(rank=rank, error=error, time=failure.timestamp))
    return exits


def _short(text: str, limit: int) -> str:
    """``text`` without C++ source locations (``[/path/pair.cc:553] ``), cut to ``limit``
    characters."""
    text = _SOURCE_LOCATION.sub("", text)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def describe_rank_failure(failures: list[RankExit]) -> tuple[str, str | None]:
    """(the ``error:`` line, the traceback of the rank it names, or None) for the failed ranks.

    The line names the cause: the earliest failure that is not a consequence of another (a lost
    peer, the launcher's SIGTERM), else the earliest; then, briefly, other ranks that failed on
    their own (not those that only lost a peer or were stopped by the launcher).
    """
    ordered = sorted(failures, key=lambda exit_: (exit_.consequence, exit_.time, exit_.rank))
    cause, others = ordered[0], [f for f in ordered[1:] if not f.consequence]
    if cause.hang:  # "made no progress for ..."
        return f"error: rank {cause.rank} {_short(cause.error, 600)}", cause.traceback
    line = f"error: rank {cause.rank} failed: {_short(cause.error, 400)}"
    same = [str(f.rank) for f in others if f.error == cause.error]
    different = [f for f in others if f.error != cause.error]
    if same:
        line += f" (so did rank{'s' if len(same) > 1 else ''} {', '.join(same)})"
    if different:
        line += (
            " (then "
            + "; ".join(f"rank {f.rank}: {_short(f.error, 100)}" for f in different[:3])
            + ")"
        )
    return line, cause.traceback


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """Silence torch elastic's failure logging while it runs (the report is ours); restore it
    afterwards."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _temporary_files_in(folder: Path) -> Iterator[None]:
    """Put this process's temporary files (torch's per-rank error files, which a killed rank leaves
    behind) into ``folder`` while the launch runs; each rank goes back to the usual temporary
    directory."""
    previous = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = previous


@contextlib.contextmanager
def _forwarding_stops(watch: RankWatch) -> Iterator[None]:
    """While the ranks run, pass SIGTERM and SIGUSR1 on to them (:mod:`preemption`): they finish
    their step, checkpoint it and end, and the launch waits for them (torch elastic's own handler,
    which would kill them 30 s later, is kept off these two: LaunchConfig.signals_to_handle)."""
    previous = {sigval: signal.getsignal(sigval) for sigval in preemption.SIGNALS}
    preemption.install(forward_to=watch.pids)
    try:
        yield
    finally:
        for sigval, handler in previous.items():
            signal.signal(sigval, handler)


def launch_local(
    entrypoint: Callable[..., Any],
    nproc: int,
    *args: Any,
    start_method: str = "fork",
    exit_on_failure: bool = True,
    max_restarts: int = 0,
    hang_timeout_s: float | None = None,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks and return each rank's result.

    ``fork`` starts a rank in well under a second once torch is imported (a fresh interpreter costs
    ~5 s); use ``spawn`` when CUDA is already initialised in this process. Fork only from a process
    that has not started OpenMP (or other) worker threads: a forked child can block for good in a
    lock a thread held. SIGTERM and SIGUSR1 to this process are passed on to the ranks, which stop
    after their step with a checkpoint (:mod:`preemption`); a second one ends them at once (status
    128 + the signal). A rank failure fails the whole launch: the other ranks are stopped within
    about a second, and (with ``exit_on_failure``) the failed rank's traceback is printed to stderr,
    then one ``error: rank N failed: ...`` line starting a fresh line, and the process exits with
    status 1 (or the one line of :func:`fail_once`, whose ranks leave it to the launcher). Without
    ``exit_on_failure`` the ``ChildFailedError`` propagates. Every rank dies with this process
    (:func:`die_with_parent`). With ``max_restarts``, a failure instead stops every rank and starts
    them all again (torch elastic's restart, as ``torchrun --max-restarts``), up to that many
    times; only the last attempt's failure is reported. A restarted rank sees
    ``TORCHELASTIC_RESTART_COUNT`` above 0 and joins a fresh world (:func:`attempt_store`). With
    ``hang_timeout_s``, a rank that makes no progress for that long (its heartbeat,
    :mod:`heartbeat`) is named and killed, and the launch fails (or restarts) as above.
    """
    with RankWatch(nproc, hang_timeout_s) as watch:
        config = _launch_config(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            # One node: a static rendezvous. The dynamic (c10d) one costs ~1.3 s per launch here,
            # most of it in inspect.stack() calls that torch elastic makes to name its log events.
            rdzv_backend="static",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_configs={"rank": 0},
            max_restarts=max_restarts,
            monitor_interval=0.1,
            signals_to_handle=preemption.ELASTIC_SIGNALS,
            start_method=start_method,
            logs_specs=DefaultLogsSpecs(
                log_dir=str(watch.folder / "elastic")
            ),  # removed with the watch
        )
        try:
            with _quiet_elastic_logs(), _temporary_files_in(watch.folder), _forwarding_stops(watch):
                return elastic_launch(config, _run_rank)(
                    str(watch.folder), os.getpid(), entrypoint, *args
                )
        except ChildFailedError as error:
            if not exit_on_failure:
                raise
            seen = watch.failures()
            known = {exit_.rank for exit_ in seen}
            failures = seen + [f for f in _from_elastic(error) if f.rank not in known]
        except (
            SignalException
        ) as error:  # this launcher was asked to stop: torch elastic stopped every rank
            if not exit_on_failure:
                raise
            stopped = f"error: stopped by {error.sigval.name}: every rank was terminated"
            print_line(stopped, sys.stderr)
            raise SystemExit(128 + int(error.sigval)) from None
    _report_failure(failures)


def _launch_config(**options: Any) -> LaunchConfig:
    """torch elastic's ``LaunchConfig`` without its NUMA default, which it looks up by calling
    ``torch.cuda.is_available()`` (CUDA started in the launcher: no forked rank could start it) and
    which is no binding anyway outside Meta (``torch._utils_internal.get_default_numa_options``)."""
    if "numa_options" not in {field.name for field in dataclasses.fields(LaunchConfig)}:
        return LaunchConfig(**options)  # an older torch, without the lookup
    config = LaunchConfig(**options, numa_options=False)  # not None: the lookup is skipped
    config.numa_options = None
    return config


def _report_failure(failures: list[RankExit]) -> NoReturn:
    """Print the ``error:`` line on a fresh line of stderr, and exit with 1: :func:`fail_once`'s
    message (the lowest rank's) when every failure is such an exit or a consequence of one, else
    the failed rank's traceback and the line naming it."""
    reported = sorted((exit_ for exit_ in failures if exit_.reported), key=lambda e: e.rank)
    if reported and all(exit_.reported or exit_.consequence for exit_ in failures):
        if reported[0].message is not None:  # None: a torchrun rank 0 said it (ranks.py)
            print_line(f"error: {reported[0].message}", sys.stderr)
        raise SystemExit(1)
    said = {exit_.rank: exit_.message for exit_ in reported if exit_.message}
    failures = [  # a fail_once among other failures: named by its message, no traceback
        dataclasses.replace(exit_, error=said[exit_.rank], traceback=None)
        if exit_.rank in said
        else exit_
        for exit_ in failures
    ]
    line, callstack = describe_rank_failure(failures)
    if callstack:  # a hung rank's: where its main thread waited when it was found
        hung = " made no progress " in line
        what = "where the hung rank waited" if hung else "traceback of the failed rank"
        line = f"{what}:\n{callstack.rstrip()}\n{line}"
    print_line(line, sys.stderr)
    raise SystemExit(1)
