"""A run owns its ``output_dir``: an exclusive lock while it runs, and a record of which run its
files belong to.

- :class:`OutputDirLock` (``output_dir/.lock``, ``fcntl.flock``): taken by the launching process
  before any rank starts, held until it exits; a second run gets :class:`OutputDirError`.
- :func:`claim_output_dir`: ``output_dir/run.json`` records the run id and config hash of the run
  the folder's files (:data:`RUN_FILES`) belong to. A fresh run into a folder holding another run's
  files is refused, naming the choices: ``checkpoint.resume=auto``, another ``output_dir``, or
  ``overwrite_output_dir=true`` (removes those files, never a file of the user's).
- a folder shardtune publishes whole (``hf/``, a checkpoint) carries a manifest of its files
  (:mod:`components.checkpoint.manifest`), so an overwrite can refuse to delete the user's own.

Design notes: docs/design-notes.md
"""

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components.paths import unused_name
from components.processes import process_alive

LOCK_FILE = ".lock"
# How long a lock whose launching process has ended is waited for: its ranks, SIGKILLed with it,
# release it as they exit (measured 0.04-0.44 s after the launcher was reaped, on 2 loaded cores).
ENDED_HOLDER_WAIT_S = 30.0
RUN_FILE = "run.json"
# What a run writes into its output_dir; only these are ever removed (overwrite_output_dir=true).
RUN_FILES = (
    "metrics.jsonl",
    "loss.png",
    "replica_drift.json",
    "config.yaml",
    "checkpoints",
    "hf",
    "adapter",
    "base",  # a LoRA adapter's base, for a model built from its config
    "tracker_runs.json",  # the MLflow and W&B runs it logs to (components/training/tracker_runs.py)
    RUN_FILE,
)


class OutputDirError(Exception):
    """The output folder cannot be used as asked; the message is one line saying why and what to
    do."""


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """The run an output folder belongs to (the content of ``run.json``)."""

    run_id: str
    config_hash: str
    started: str
    files: tuple[str, ...] = RUN_FILES  # what the run may write there, and overwrite may remove


def config_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of a resolved config (a plain, JSON-able mapping)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


class OutputDirLock:
    """An exclusive ``flock`` on ``output_dir/.lock``; use as a context manager or call
    :meth:`release`."""

    def __init__(self, output_dir: Path, ended_holder_wait_s: float = ENDED_HOLDER_WAIT_S) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.ended_holder_wait_s = ended_holder_wait_s
        self._fd: int | None = None

    def acquire(self) -> "OutputDirLock":
        """Take the lock (creating ``output_dir``) and write this process's pid, host and start time
        into it.

        A lock whose holder (the launching process named in it, on this host) has ended is held
        only by what that process forked with it, its ranks, which die with it
        (:func:`components.processes.die_with_parent`): it is waited for, up to
        ``ended_holder_wait_s``, rather than refused while they exit.

        Raises:
            OutputDirError: If another process holds it (naming that process; or naming the ended
                holder whose processes still hold it after the wait), or the folder cannot be
                made.
        """
        while (fd := self._open_locked()) is None:  # the holder removed the file as we took it
            pass
        os.ftruncate(fd, 0)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def _open_locked(self) -> int | None:
        """The lock file, opened and flocked; None when the file was removed (a releasing holder
        unlinks it) between the open and the lock, so the caller opens the new one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise OutputDirError(
                f"output_dir {self.path.parent} cannot be used: {error.strerror or error}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            if not _taken_once_its_ranks_end(fd, _holder(text), self.ended_holder_wait_s):
                os.close(fd)
                raise OutputDirError(_in_use(self.path.parent, _holder(text))) from None
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:
            os.close(fd)
            return None
        return fd

    def release(self) -> None:
        """Give the lock up (idempotent) and remove the lock file, so no ``.lock`` naming a finished
        run stays behind; process exit gives the lock up too (the file a killed holder leaves is
        taken over by the next run and removed at its release)."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # still held: a newcomer that opened it retries
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputDirLock":
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _holder(text: str) -> dict[str, Any] | None:
    """The holder a lock file names (pid, host, started), or None when it names none readable (a
    holder that has not written it yet)."""
    try:
        holder = json.loads(text)
        return holder if {"pid", "host", "started"} <= set(holder) else None
    except (ValueError, TypeError):
        return None


def _ended_here(holder: dict[str, Any] | None) -> bool:
    """Whether ``holder`` is a process of this host that has ended (a pid reused since reads as
    alive: refused, as before)."""
    return (
        holder is not None
        and holder["host"] == socket.gethostname()
        and not process_alive(holder["pid"])
    )


def _taken_once_its_ranks_end(fd: int, holder: dict[str, Any] | None, wait_s: float) -> bool:
    """Whether the lock on ``fd`` was taken within ``wait_s`` of polling, for a ``holder`` that has
    ended (its dying ranks still hold the lock); False at once for any other holder."""
    if not _ended_here(holder):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _in_use(folder: Path, holder: dict[str, Any] | None) -> str:
    """The refusal of a lock held by ``holder``, in one line."""
    if holder is None:
        return (
            f"output_dir {folder} is in use by another run (holder unknown); wait for it to end "
            "or choose another output_dir"
        )
    named = f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    if _ended_here(holder):
        return (
            f"output_dir {folder} is still held by processes of a run whose launcher ({named}) "
            "has ended; end them (they hold its .lock) or choose another output_dir"
        )
    return (
        f"output_dir {folder} is in use by another run ({named}); wait for it to end or choose "
        "another output_dir"
    )


def lock_output_dir(output_dir: Path) -> OutputDirLock:
    """Take ``output_dir``'s lock for the rest of this process's life (see
    :class:`OutputDirLock`)."""
    return OutputDirLock(output_dir).acquire()


def run_output_folder(
    configured: str, written: str, sweep_job_dir: str | None
) -> tuple[Path, bool]:
    """The run's output folder: a sweep job's own (``sweep_job_dir``), else ``configured`` (the
    resolved ``output_dir``), made absolute; and whether the config as ``written`` names a folder
    per run (``${now:...}``), where a run started in the same second as another takes
    :func:`unused_name`'s next name (``DATE_TIME_2``)."""
    output = Path(sweep_job_dir or configured).expanduser().absolute()
    per_run = "${now:" in written
    if per_run and sweep_job_dir is None:
        output = unused_name(output)
    return output, per_run


def _foreign_in_checkpoints(folder: Path) -> list[str]:
    """Entries of ``checkpoints/`` that are not checkpoint folders (``step_N``, ``.tmp``,
    ``.old``)."""
    if not folder.is_dir():
        return []
    return sorted(child.name for child in folder.iterdir() if not child.name.startswith("step_"))


def run_files(output_dir: Path) -> list[str]:
    """The :data:`RUN_FILES` present in ``output_dir``."""
    return [name for name in RUN_FILES if (Path(output_dir) / name).exists()]


def _user_files_in_ours(output_dir: Path) -> list[str]:
    from components.checkpoint.manifest import foreign_files  # on use: the checks stay light

    output_dir = Path(output_dir)
    found = [f"hf/{name}" for name in foreign_files(output_dir / "hf")]
    found += [f"checkpoints/{name}" for name in _foreign_in_checkpoints(output_dir / "checkpoints")]
    return found


def remove_run_files(output_dir: Path, record: RunRecord) -> list[str]:
    """Remove the files in ``output_dir`` that the run ``record`` (its ``run.json``) lists; return
    their names. Nothing else is touched.

    Raises:
        OutputDirError: If ``hf/``, ``tokenizer/`` or ``checkpoints/`` hold files of the user's
            (before anything is removed), naming them.
    """
    if user := _user_files_in_ours(output_dir):
        raise OutputDirError(
            f"output_dir {output_dir} holds files shardtune did not write inside its own folders "
            f"({', '.join(user[:5])}{' ...' if len(user) > 5 else ''}); move them, or choose "
            "another output_dir"
        )
    removed = [name for name in run_files(output_dir) if name in record.files]
    for name in removed:
        path = Path(output_dir) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


def nested_run_errors(output_dir: Path) -> list[str]:
    """Why ``output_dir`` cannot hold a run because of another run's folder around or below it (one
    phrase), or nothing. Judged on the real path (symlinks resolved): a link into another run's
    ``checkpoints/`` or ``hf/`` is inside that run. Any folder inside another run's folder (one with
    a ``run.json``) would mix its files with that run's, or be deleted by its pruning or overwrite;
    a folder above other runs' folders would hold their files as its own. Below,
    :data:`_NESTED_DEPTH` levels are looked at."""
    if inside := inside_run_errors(output_dir):
        return inside
    if below := run_folder_below(Path(output_dir).resolve()):
        return [
            f"output_dir {shown_path(output_dir)} holds the output folder of another run below it "
            f"({below}, with its {RUN_FILE}): nested output folders are not allowed; choose an "
            "output_dir that holds no other run's folder"
        ]
    return []


def inside_run_errors(output_dir: Path) -> list[str]:
    """Why ``output_dir`` (its real path) cannot hold a run: it is inside another run's output
    folder (one above it holds a ``run.json``); or nothing."""
    for parent in Path(output_dir).resolve().parents:
        if (parent / RUN_FILE).is_file():
            return [
                f"output_dir {shown_path(output_dir)} is inside the output folder of another run "
                f"({parent}, with its {RUN_FILE}), whose pruning or overwrite would delete it: "
                f"nested output folders are not allowed; choose an output_dir outside {parent}"
            ]
    return []


def shown_path(path: Path) -> str:
    """``path`` as given, and where a link leads when its real path differs."""
    given = Path(path)
    real = given.resolve()
    return str(given) if real == given else f"{given} (a link to {real})"


_NESTED_DEPTH = 4  # levels below an output_dir searched for another run's folder
_NESTED_FOLDERS = 10_000  # and at most this many folders (an output_dir of ~ stays quick)


def run_folder_below(folder: Path) -> Path | None:
    """The first folder (breadth first, links not followed) below ``folder`` holding a
    ``run.json``, or None."""
    level, seen = ([folder] if folder.is_dir() else []), 0
    for _ in range(_NESTED_DEPTH):
        children = []
        for parent in level:
            try:
                children += [child for child in parent.iterdir() if _real_folder(child)]
            except OSError:
                continue
        for child in sorted(children):
            if (child / RUN_FILE).is_file():
                return child
        seen += len(children)
        if seen > _NESTED_FOLDERS:
            return None
        level = children
    return None


def _real_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def read_run_record(output_dir: Path) -> RunRecord | None:
    """The run ``output_dir`` belongs to (``run.json``), or None when there is no readable
    record."""
    try:
        fields = json.loads((Path(output_dir) / RUN_FILE).read_text())
        return RunRecord(**{**fields, "files": tuple(fields["files"])})
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _write_record(output_dir: Path, record: RunRecord) -> RunRecord:
    write_whole(Path(output_dir) / RUN_FILE, json.dumps(asdict(record), indent=1))
    return record


def write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or stays as it was: written beside it and renamed over it;
    the private copy is removed when the write fails (a full disk)."""
    private = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        private.write_text(text)
        os.replace(private, path)
    except BaseException:
        private.unlink(missing_ok=True)
        raise


def claim_output_dir(
    output_dir: Path, config_hash: str, *, continuing: bool, overwrite: bool, resumable: bool
) -> RunRecord:
    """Make ``output_dir`` this run's and return its record; call it holding the lock, before any
    rank starts.

    ``continuing``: this run resumes from a checkpoint (the folder's run goes on: its run id is
    kept, so ``keep`` pruning continues over its checkpoints). Otherwise a folder holding another
    run's files is refused unless ``overwrite``, which removes exactly those files first;
    ``resumable`` (a resume would continue the folder's run: it holds a complete checkpoint, and
    no resume asked for here found none) only changes the refusal's advice. Either way a new
    ``run.json`` records the run id and ``config_hash``.

    Raises:
        OutputDirError: One line: the folder holds another run's files (naming them and the three
            choices), or the user's own files sit inside ours (naming them), or files of shardtune's
            names that no ``run.json`` records (a user's own ``config.yaml``: never replaced, even
            with ``overwrite``).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if user := _user_files_in_ours(output_dir):
        raise OutputDirError(
            f"output_dir {output_dir} holds files shardtune did not write inside its own folders "
            f"({', '.join(user[:5])}{' ...' if len(user) > 5 else ''}); move them, or choose "
            "another output_dir"
        )
    previous = read_run_record(output_dir)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    present = run_files(output_dir)
    if present and previous is None:  # no run recorded them: the user's, whatever their names
        raise OutputDirError(
            f"output_dir {output_dir} holds {', '.join(present)} but no readable {RUN_FILE} of a "
            "shardtune run, so they may be your own files and nothing there is replaced or removed "
            "(not even with overwrite_output_dir=true): move them, or choose another output_dir=..."
        )
    if continuing:
        run_id = previous.run_id if previous is not None else uuid.uuid4().hex
        record = RunRecord(run_id=run_id, config_hash=config_hash, started=started)
        return _write_record(output_dir, record)
    if present:
        if not overwrite:
            choices = (
                "to keep it choose another output_dir=..., "
                "to replace it set overwrite_output_dir=true"
            )
            if resumable:
                choices = f"; to continue that run set checkpoint.resume=auto, {choices}"
            else:
                choices = f" and no complete checkpoint to resume from; {choices}"
            raise OutputDirError(
                f"output_dir {output_dir} holds another run's files ({', '.join(present)}){choices}"
            )
        remove_run_files(output_dir, previous)
    record = RunRecord(run_id=uuid.uuid4().hex, config_hash=config_hash, started=started)
    return _write_record(output_dir, record)
