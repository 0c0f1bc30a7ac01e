"""Heartbeats: a rank that stops progressing (stopped, frozen, stuck in a kernel or a collective) is
found within ``hang_timeout_s`` rather than the collective timeout.

A rank's main thread marks its progress (:func:`progress`) and says which stretches are judged on it
(:func:`watched`: the training steps); a daemon thread writes the rank's beat file a few times per
timeout: a sequence number, the last mark, how long ago it was and, once the main thread has been
idle a while, where it waits. A watcher (:class:`HangWatch`: the recipe's launcher, or under
torchrun every rank for its node's ranks, :func:`beating`) finds a hang where a beat file stopped
changing (the process is stopped) or a watched main thread made no mark for the timeout; any other
phase (set-up, saves, validation, export) counts as progress while the process beats.

Design notes: docs/design-notes.md
"""

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from components.processes import process_exists
from components.runtime.console import print_line

# The folder a local launcher shares with its ranks (their pids, errors and beats).
RANKS_FOLDER = "SHARDTUNE_RANKS_FOLDER"
# Under torchrun, the local ranks' shared folder: this prefix, then the torchrun agent's pid (the
# same prefix as a local launcher's, so a later launch removes it once that pid is gone).
NODE_FOLDER_PREFIX = "shardtune-ranks-"
_SILENT_BEATS = 3  # a beat file unchanged for this many intervals: its process is not running
_BEAT_BYTES = 8192  # a beat file's size: a torn read is rare, and skipped as unreadable
_ABORT_GRACE_S = 0.5  # for the error line's print (torchrun: :func:`_end_node`)


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats (and between a watcher's looks): an eighth of the timeout, within
    [0.25, 5]."""
    return min(5.0, max(0.25, timeout_s / 8))


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def beat_path(folder: Path, rank: int, attempt: str) -> Path:
    return folder / f"{rank}.{attempt}.beat"


@dataclass(frozen=True, kw_only=True)
class Beat:
    """One rank's latest beat, as its file says."""

    rank: int
    pid: int
    seq: int  # counts the beats: unchanged, the process did not run
    marks: int  # progress marks so far: the rank with fewer is behind
    what: str  # the last mark
    idle_s: float  # since the last mark
    watched: bool  # judged on progress now (a training step), else on its beat alone
    waiting_in: str | None = None  # where the main thread waits, once idle a while
    collective: bool = False  # ... in torch.distributed (a collective, most likely)
    stack: str | None = None  # the main thread's stack then

    @classmethod
    def read(cls, path: Path) -> "Beat | None":
        with contextlib.suppress(OSError, ValueError, TypeError):
            return cls(**json.loads(path.read_text()))
        return None


class Heartbeat:
    """A rank's marks (main thread) and the thread that writes them to its beat file."""

    def __init__(self, path: Path, rank: int, timeout_s: float) -> None:
        self.path, self.rank, self.timeout_s = path, rank, timeout_s
        self.interval = beat_interval(timeout_s)
        self._last = ("setting up", time.monotonic(), 0)  # (what, when, marks): one assignment
        self._watched = False
        self._seq = 0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writing = threading.Lock()  # the main thread beats too (:meth:`watched`)
        self._fd: int | None = None

    def progress(self, what: str) -> None:
        """A mark: the main thread got to ``what``."""
        self._last = (what, time.monotonic(), self._last[2] + 1)

    @contextlib.contextmanager
    def watched(self, what: str, judged: bool = True) -> Iterator[None]:
        """A stretch judged on progress (when ``judged``): marks must follow each other within
        the timeout."""
        self.progress(what)
        self._watched = judged
        with contextlib.suppress(OSError):
            self.beat()  # what a rank stopped in this stretch was doing: one small file a step
        try:
            yield
        finally:
            self._watched = False
            self.progress(f"after {what}")

    def beat(self) -> Beat:
        """Write this rank's beat file; returns what it wrote."""
        with self._writing:
            return self._beat()

    def _beat(self) -> Beat:
        what, when, marks = self._last
        idle_s = time.monotonic() - when
        self._seq += 1
        beat = Beat(rank=self.rank, pid=os.getpid(), seq=self._seq, marks=marks, what=what,
                    idle_s=round(idle_s, 2), watched=self._watched)  # fmt: skip
        if self._watched and idle_s > self.timeout_s / 2:
            beat = _with_stack(beat, sys._current_frames().get(self._main))
        text = json.dumps(beat.__dict__)
        if len(text) > _BEAT_BYTES:
            text = json.dumps(beat.__dict__ | dict(stack=None))
        if self._fd is None:
            self._fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o644)
        # in place, padded to one size: a few microseconds (a new file and a rename: ~0.3 ms)
        os.pwrite(self._fd, text.ljust(_BEAT_BYTES).encode(), 0)
        return beat

    def start(self, peers: "HangWatch | None") -> None:
        """Beat from a daemon thread until :meth:`stop`; with ``peers`` (torchrun), end this node's
        ranks on a hang."""
        self.beat()
        self._thread = threading.Thread(target=self._run, args=(peers,), daemon=True)
        self._thread.start()

    def _run(self, peers: "HangWatch | None") -> None:
        while not self._stop.wait(self.interval):
            hang = None
            with contextlib.suppress(OSError):  # a beat missed now and then is no hang
                self.beat()
                hang = peers.look(_attempt()) if peers is not None else None
            if peers is not None and (hang is not None or _ended(peers.folder)):
                _end_node(hang, peers.folder, self.interval)

    def stop(self) -> None:
        """Stop beating and remove the beat file: a rank that is done is not watched."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
        self.path.unlink(missing_ok=True)


def _with_stack(beat: Beat, frame) -> Beat:
    """``beat`` with where ``frame`` (the main thread's) waits: a torch.distributed function among
    the torch frames it is in (a collective, most likely), else its innermost function."""
    if frame is None:
        return beat
    waiting_in, inner, torch_files = None, frame, f"{os.sep}torch{os.sep}"
    while inner is not None and torch_files in inner.f_code.co_filename and waiting_in is None:
        if f"torch{os.sep}distributed{os.sep}" in inner.f_code.co_filename:
            waiting_in = inner.f_code.co_name
        inner = inner.f_back
    collective = waiting_in is not None
    if waiting_in is None:
        code = frame.f_code
        waiting_in = f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"
    stack = "".join(traceback.format_stack(frame)[-12:])
    where = dict(waiting_in=waiting_in, collective=collective, stack=stack)
    return Beat(**beat.__dict__ | where)


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A hang found: the rank named as its cause, the line that says so, the ranks to end."""

    rank: int
    text: str  # "made no progress for 12 s (...)", after "rank 1 "
    stack: str | None  # the named rank's main thread, if it was seen idle
    pids: dict[int, int]  # rank -> pid of every rank beating in the attempt
    silent: list[int]  # ranks whose process does not run (stopped): SIGKILL them


class HangWatch:
    """Reads the beat files of ``folder`` and finds a hang: a beat file unchanged for the timeout
    (on this process's clock, so clocks of other hosts do not matter), or a watched rank idle for
    it. ``look`` is called every :func:`beat_interval`."""

    def __init__(self, folder: Path, timeout_s: float, clock=time.monotonic) -> None:
        self.folder, self.timeout_s, self._clock = folder, timeout_s, clock
        self.interval = beat_interval(timeout_s)
        self._changed: dict[tuple[int, int], tuple[int, float]] = {}  # (rank, pid) -> (seq, at)

    def look(self, attempt: str, pids: dict[int, int] | None = None) -> Hang | None:
        """The hang among ``attempt``'s beats, or None; ``pids``: only these ranks' processes
        (rank -> pid: a launcher's ranks still running)."""
        now, beats, ages = self._clock(), [], {}
        for path in sorted(self.folder.glob(f"*.{attempt}.beat")):
            beat = Beat.read(path)
            if beat is None or (pids is not None and pids.get(beat.rank) != beat.pid):
                continue
            seq, at = self._changed.get((beat.rank, beat.pid), (None, now))
            self._changed[(beat.rank, beat.pid)] = (beat.seq, at if seq == beat.seq else now)
            beats.append(beat)
            with contextlib.suppress(OSError):  # written on this host: its clock is ours
                ages[beat.rank] = max(0.0, time.time() - path.stat().st_mtime)
        silent_s = {b.rank: now - self._changed[(b.rank, b.pid)][1] for b in beats}
        stuck = [b for b in beats if b.watched and b.idle_s > self.timeout_s]
        if not stuck and max(silent_s.values(), default=0) <= self.timeout_s:
            return None
        silent = {b.rank for b in beats if silent_s[b.rank] > _SILENT_BEATS * self.interval}
        idle_s = {b.rank: b.idle_s + ages.get(b.rank, silent_s[b.rank]) for b in beats}
        return _hang(beats, silent, idle_s, self.timeout_s)


def _process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (T: stopped), or None."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return None


def _hang(beats: list[Beat], silent: set[int], idle_s: dict[int, float], timeout_s: float) -> Hang:
    """The hang's cause among ``beats``: a rank whose process does not run (stopped, or
    ``silent``), else the one behind (fewest marks), else one not waiting in a collective."""
    stopped = silent | {b.rank for b in beats if _process_state(b.pid) == "T"}

    def suspicion(beat: Beat) -> tuple:
        return (beat.rank not in stopped, beat.marks, beat.collective, beat.rank)

    cause = min(beats, key=suspicion)
    idle = round(idle_s[cause.rank])
    text = f"made no progress for {idle} s (hang_timeout_s={timeout_s:g}), {_where(cause)}"
    if cause.rank in stopped:
        state = "is stopped" if _process_state(cause.pid) == "T" else "sent no heartbeat"
        text += f": its process {state} (pid {cause.pid})"
    others = [f"rank {b.rank} {_where(b)}" for b in beats if b.rank != cause.rank][:3]
    if others:
        text += f"; {'; '.join(others)}"
    pids = {b.rank: b.pid for b in beats}
    return Hang(rank=cause.rank, text=text, stack=cause.stack, pids=pids, silent=sorted(stopped))


def _where(beat: Beat) -> str:
    return f"at {beat.what}" + (f", waiting in {beat.waiting_in}" if beat.waiting_in else "")


def _ended(folder: Path) -> bool:
    return (folder / f"hang.{_attempt()}").exists()


def _end_node(hang: Hang | None, folder: Path, interval: float) -> NoReturn:
    """Under torchrun, end this rank with status 1 (torchrun ends or restarts the world). The first
    of the node's ranks to find the ``hang`` notes it for the others, prints the ``error:`` line,
    waits a beat for them to end quietly, then SIGKILLs the stopped ranks."""
    try:
        os.close(os.open(folder / f"hang.{_attempt()}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        hang = None  # another rank found it first and says so
    if hang is not None:
        line = f"error: rank {hang.rank} {hang.text}"
        if hang.stack:
            line = f"where rank {hang.rank}'s main thread waited:\n{hang.stack.rstrip()}\n{line}"
        print_line(line, sys.stderr)
        time.sleep(interval + _ABORT_GRACE_S)
        for stopped in hang.silent:
            with contextlib.suppress(OSError):
                os.kill(hang.pids[stopped], signal.SIGKILL)
    else:
        time.sleep(_ABORT_GRACE_S)  # the line is printed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


_current: Heartbeat | None = None


def progress(what: str) -> None:
    """Mark this rank's progress (a no-op without :func:`beating`)."""
    if _current is not None:
        _current.progress(what)


def watched(what: str, judged: bool = True) -> contextlib.AbstractContextManager:
    """:meth:`Heartbeat.watched` of this rank's heartbeat (a no-op without :func:`beating`)."""
    return _current.watched(what, judged) if _current is not None else contextlib.nullcontext()


def remove_dead_folders(folder: Path) -> None:
    """Remove the rank folders under ``folder`` of launchers (ours, or torchrun) that no longer
    exist (a SIGKILL, or ranks ended on a hang, leave them behind); a live one's is left alone."""
    for child in folder.glob(f"{NODE_FOLDER_PREFIX}*-*"):
        pid = child.name.removeprefix(NODE_FOLDER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


def node_folder() -> Path:
    """Under torchrun, the folder this node's ranks share: named by their parent's pid (torchrun's
    agent) and the world's store port, so two worlds started by one parent never share beats."""
    remove_dead_folders(Path(tempfile.gettempdir()))
    world = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
    folder = Path(tempfile.gettempdir(), f"{NODE_FOLDER_PREFIX}{world}-torchrun")
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to another user")
    return folder


@contextlib.contextmanager
def beating(timeout_s: float | None) -> Iterator[None]:
    """This rank beats while the block runs, starting in a phase judged on its beat alone. Under a
    local launcher the launcher watches (``RANKS_FOLDER``); under torchrun every rank watches this
    node's ranks. ``timeout_s`` None: nothing beats (the collective timeout alone)."""
    global _current
    launcher_folder = os.environ.get(RANKS_FOLDER)
    if timeout_s is None:
        yield
        return
    folder = Path(launcher_folder) if launcher_folder else node_folder()
    rank = int(os.environ["RANK"])
    heart = Heartbeat(beat_path(folder, rank, _attempt()), rank, timeout_s)
    heart.start(None if launcher_folder else HangWatch(folder, timeout_s))
    _current = heart
    try:
        yield
    finally:
        _current = None
        heart.stop()
        if not launcher_folder:
            with contextlib.suppress(OSError):
                folder.rmdir()  # the last rank out removes it
