"""Where a run writes and what it resumes, as checked before anything is claimed: ``output_dir``
can be a run's folder (writable, not nested in another run's), agrees with ``hydra.run.dir``, and
an explicit ``checkpoint.resume`` is a checkpoint folder at all (whether it is usable is decided
under the folder's lock). Reads the filesystem, writes nothing."""

import os
from pathlib import Path

from components.checkpoint.integrity import MARKER, complete_checkpoints
from components.problems import Problem, problems, show
from components.runtime.output_dir import RUN_FILES, nested_run_errors


def where_errors(output: Path, run_dir: str | None, per_run: bool, torchrun: bool) -> list[Problem]:
    """``output_dir`` (``output``) is where a run writes: a ``hydra.run.dir`` (``run_dir``) that
    names another folder is refused rather than silently obeyed or ignored; under torchrun the
    default folder per run (``per_run``: named by the date and time each rank reads for itself)
    could differ between ranks, so one must be given."""
    errors = []
    if run_dir is not None and Path(run_dir).expanduser().absolute() != output:
        disagree = (
            f"hydra.run.dir={show(run_dir)} and output_dir={show(str(output))} disagree: a run "
            f"writes to output_dir, so drop hydra.run.dir or set output_dir={show(run_dir)}"
        )
        errors.append(Problem(key="hydra.run.dir", message=disagree))
    if per_run and torchrun:
        given = (
            "output_dir must be given under torchrun (e.g. output_dir=outputs/my_run): the "
            "default, a new folder per run named by date and time, is read by each rank for itself"
        )
        errors.append(Problem(key="output_dir", message=given))
    return errors


def check_output_dir(path: Path) -> list[Problem]:
    """``output_dir`` is a folder, or can be created as one, and can be written, and is neither
    inside another run's output folder nor holding one."""
    return problems("output_dir", _output_dir_errors(path))


def _output_dir_errors(path: Path) -> list[str]:
    return writable_folder_errors(path) or nested_run_errors(path)


def writable_folder_errors(path: Path) -> list[str]:
    """Why ``output_dir`` (``path``) cannot be a folder this process writes in (a file, under a
    file, not writable), or nothing."""
    if path.exists() and not path.is_dir():
        return [f"output_dir={show(str(path))} is a file, not a folder: choose another output_dir"]
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        return [
            f"output_dir={show(str(path))} cannot be created: {existing} is a file; choose "
            "another output_dir"
        ]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            f"output_dir={show(str(path))} is not writable ({existing}): choose a folder you can "
            "write to"
        ]
    return []


def explicit_checkpoint_errors(resume: str | None) -> list[Problem]:
    """An explicit ``checkpoint.resume`` path that is not even a checkpoint folder (checked with the
    config)."""
    return problems("checkpoint.resume", _not_a_checkpoint(resume))


def _not_a_checkpoint(resume: str | None) -> list[str]:
    if resume in (None, "auto"):
        return []
    path = Path(resume).expanduser().absolute()
    if (
        (path / MARKER).is_file()
        or path.is_dir()
        and path.name.startswith("step_")
        and path.suffix != ".tmp"
    ):
        return []  # a checkpoint folder: whether it is usable is checked under the lock
    if not path.is_dir():
        why = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
    elif found := complete_checkpoints(path):
        return [
            f"checkpoint.resume={show(resume)} holds checkpoints but is not one: use "
            f"checkpoint.resume={found[-1]}"
        ]
    elif path.name.endswith(".tmp"):
        why = "is an unfinished save (no COMPLETE marker)"
    else:
        why = f"is not a complete checkpoint (no {MARKER} marker)"
    return [
        f"checkpoint.resume={show(resume)} {why}: use auto, null or a step_NNNNNNNN checkpoint "
        "folder"
    ]


def overwritten_model_problems(
    output: Path, overwrite: bool, folders: dict[str, str | None]
) -> list[Problem]:
    """A model folder the run reads (``folders``: by key) among the run files that
    ``overwrite_output_dir=true`` removes from ``output`` before training (a run's own ``hf/``
    given back as its model): removed, it could not be loaded."""
    found = []
    for key, given in folders.items() if overwrite else ():
        if given is None:
            continue
        folder = Path(given).expanduser().absolute()
        parts = folder.relative_to(output).parts if folder.is_relative_to(output) else ()
        if parts and parts[0] in RUN_FILES:
            found.append(
                Problem(
                    key=key,
                    message=f"{key}={given} lies in {output}'s run files, which "
                    "overwrite_output_dir=true removes before the run starts: copy the folder "
                    "out of it, or choose another output_dir",
                )
            )
    return found
