"""The folder of a ``--multirun`` sweep (``hydra.sweep.dir``, that is ``output_dir``; its jobs
write ``output_dir/0``, ``/1``, ...), judged before Hydra writes its ``multirun.yaml`` there, and
left with nothing of the sweep's own when no job ran.

:class:`SweepFolder` is a Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): a folder
that is or is inside a run's folder, holds another sweep's jobs, or holds other runs' folders is
refused in one ``error:`` line; the same sweep run again (``checkpoint.resume=auto`` continues its
jobs) is not. A refused job's empty folder is removed, and so is the ``multirun.yaml`` of a sweep
none of whose jobs claimed its folder.
"""

from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from components.runtime.output_checks import writable_folder_errors
from components.runtime.output_dir import (
    RUN_FILE,
    inside_run_errors,
    run_files,
    run_folder_below,
    shown_path,
)
from components.runtime.problems import fail

SWEEP_RECORD = "multirun.yaml"  # Hydra's record of the sweep, in its folder
# Overrides a sweep may add or change when run again over its own jobs: continue them, redo them
AGAIN = ("checkpoint.resume=", "overwrite_output_dir=")


class SweepFolder(Callback):
    """Refuses a sweep whose folder holds another run's or sweep's files before anything is
    written; after the sweep, removes what it wrote that holds no run."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.existed: set[Path] = set()  # the folder and its entries before the sweep
        self.made_below: Path | None = None  # the folder's nearest ancestor before the sweep

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir)).absolute()
        sweep = (str(config.hydra.job.config_name), list(config.hydra.overrides.task))
        if errors := sweep_folder_errors(folder, *sweep):
            fail(errors[0])
        self.folder = folder
        self.existed = {folder, *folder.iterdir()} if folder.is_dir() else set()
        self.made_below = next(parent for parent in (folder, *folder.parents) if parent.exists())

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        """A job that wrote nothing (refused) leaves no empty folder of its own."""
        job = Path(str(config.hydra.runtime.output_dir))
        if self.folder is None or job in self.existed:  # not a sweep's job; or not its folder
            return
        if job.is_dir() and not any(job.iterdir()):
            job.rmdir()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """No job claimed a folder: the sweep's record goes, and the empty folders it made (its
        own, and those above it that Hydra made for it)."""
        folder = self.folder
        if folder is None or not folder.is_dir() or job_folders_with_runs(folder):
            return
        (folder / SWEEP_RECORD).unlink(missing_ok=True)
        chain = (folder, *folder.parents)
        for path in chain[: chain.index(self.made_below)]:  # the folders the sweep made
            if any(path.iterdir()):
                return
            path.rmdir()


def sweep_folder_errors(folder: Path, config_name: str, overrides: list[str]) -> list[str]:
    """Why the sweep of ``config_name`` with ``overrides`` cannot write its jobs into ``folder``
    (one phrase), or nothing."""
    if unusable := writable_folder_errors(folder):
        return unusable
    shown = shown_path(folder)
    if (folder / RUN_FILE).is_file():
        return [
            f"output_dir {shown} is the output folder of a run (with its {RUN_FILE}): a --multirun "
            f"sweep writes its jobs' folders {shown}/0, {shown}/1, ... and never inside another "
            "run's folder; choose another output_dir"
        ]
    if inside := inside_run_errors(folder):
        return inside
    if (folder / SWEEP_RECORD).is_file():
        theirs = recorded_sweep(folder / SWEEP_RECORD)
        if theirs == (config_name, sweep_identity(overrides)) or not job_folders_with_runs(folder):
            return []  # the same sweep again, or one whose jobs all were refused
        listed = " ".join(theirs[1]) if theirs else "unreadable"
        return [
            f"output_dir {shown} holds the jobs of another sweep (its {SWEEP_RECORD}: {listed}): "
            "a sweep never writes into another's folder; choose another output_dir, or run that "
            "sweep's own command again (checkpoint.resume=auto continues its jobs)"
        ]
    if below := run_folder_below(folder.resolve()):
        return [
            f"output_dir {shown} holds the output folder of another run below it ({below}, with "
            f"its {RUN_FILE}) and no sweep's {SWEEP_RECORD}: a --multirun sweep writes its jobs' "
            "folders there; choose an output_dir that holds no other run's folder"
        ]
    return []


def sweep_identity(overrides: list[str]) -> list[str]:
    """A sweep's overrides less those it may change when run again over its own jobs."""
    return [override for override in overrides if not override.startswith(AGAIN)]


def recorded_sweep(path: Path) -> tuple[str, list[str]] | None:
    """(config name, :func:`sweep_identity`) of the sweep Hydra's ``multirun.yaml`` records, or
    None when it cannot be read as one."""
    try:
        hydra = yaml.safe_load(path.read_text())["hydra"]
        return str(hydra["job"]["config_name"]), sweep_identity(list(hydra["overrides"]["task"]))
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None


def job_folders_with_runs(folder: Path) -> list[str]:
    """The entries of ``folder`` (a sweep's jobs' folders) that hold a run's files."""
    return sorted(child.name for child in folder.iterdir() if child.is_dir() and run_files(child))
