"""Sharded, atomic training checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find the latest, resume.

One checkpoint is the folder ``root/step_00000042/``:

- DCP files (``.metadata``, ``__<rank>_0.distcp``): model and optimizer state from ``get_state_dict``. Each
  rank writes its own shards, stored by global shape, so a load at another tp or dp size reshards them.
- ``trainer_state.pt`` (rank 0): the step, the LR scheduler's state, the caller's ``extra``, the world size.
- ``rng/rank_00000.pt`` (one per rank): that rank's torch CPU, CUDA (current device), Python and NumPy RNG
  states, so a resume at the same world size continues bitwise like an uninterrupted run.
- ``COMPLETE``: the marker, written last.

Atomicity: every rank writes into ``step_00000042.tmp``; after all ranks are done rank 0 writes the marker
and renames the folder (one ``os.replace``, atomic on one filesystem). A crash leaves a ``.tmp`` folder,
which :func:`latest_checkpoint` never returns and the next save of that step replaces. All ranks must see
the same filesystem (a shared one across nodes).

Test hook: with the environment variable ``SHARDTUNE_TEST_SAVE_DELAY_S`` set to a number of seconds, every
save sleeps that long after all ranks have written their files and before the marker and rename, so a test
can kill a run in the middle of a save (tests/e2e/test_failures.py). It is for tests only; never set it.
"""

import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
RNG_DIR = "rng"
_NAME = re.compile(r"^step_(\d{8,})$")
# Optimizer state and hyperparameters keyed by parameter name ("optim.state.<fqn>.exp_avg",
# "optim.param_groups.<fqn>.lr"), so a load does not depend on param-group order. The unflattened layout
# reshards across tp/dp just as well (measured); this one is what torchtitan uses.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Test-only: seconds each save waits between writing its files and committing them (see the module doc).
TEST_SAVE_DELAY_ENV = "SHARDTUNE_TEST_SAVE_DELAY_S"


def checkpoint_path(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step_{step:08d}"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_on_rank0(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 only; every rank returns after it has finished, and every rank raises if it
    failed (rank 0 its own exception, the others a RuntimeError quoting it), so no rank is left waiting."""
    rank, world = _rank_and_world()
    failure: Exception | None = None
    if rank == 0:
        try:
            action()
        except Exception as error:
            failure = error
    if world > 1:
        shared = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None and failure is None:
            raise RuntimeError(f"rank 0 failed: {shared[0]}")
    if failure is not None:
        raise failure


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(state["numpy"])


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_DIR / f"rank_{rank:05d}.pt"


def _fresh_folder(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)  # left by a crashed save of the same step
    (folder / RNG_DIR).mkdir(parents=True)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_marker(folder: Path, step: int, world_size: int) -> None:
    with open(folder / MARKER, "w") as marker:
        json.dump({"step": step, "world_size": world_size}, marker)
        marker.flush()
        os.fsync(marker.fileno())


def publish_folder(tmp: Path, final: Path) -> None:
    """Atomically put the finished folder ``tmp`` at ``final``; an existing ``final`` is moved aside first,
    then removed, so a crash at any point leaves one complete folder (old or new) under a known name."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_folder(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _commit(tmp: Path, final: Path, step: int, world_size: int, keep: int | None) -> None:
    """Mark ``tmp`` complete and rename it to ``final`` (replacing an older save of the same step)."""
    _write_marker(tmp, step, world_size)
    publish_folder(tmp, final)
    if keep is not None:
        older = [path for path in _complete_checkpoints(final.parent) if path != final]
        for path in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(path)


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_only: bool) -> dict[str, Any]:
    """What DCP saves or loads in place: the model's, and unless ``model_only`` the optimizer's, state.

    ``model_only`` is for an optimizer without per-parameter state (never stepped, or stateless like plain
    SGD): ``get_state_dict`` would create state by running a step with zero grads and lr 0, which for
    AdamW counts as step 1 and so changes the run. Its hyperparameters travel in ``trainer_state.pt``.
    """
    if model_only:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_state, "optim": optimizer_state}


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Save model, optimizer, scheduler, ``step``, ``extra`` and every rank's RNG states; return the folder.

    Collective: every rank calls it with the same arguments. ``extra`` (picklable, e.g. the data position)
    comes back from :func:`load_checkpoint`. With ``keep``, only the newest ``keep`` complete checkpoints
    under ``root`` survive (this one always does). The RNG states are those at the call, and the call
    leaves them as it found them, so saving does not perturb the run.

    Raises:
        ValueError: If ``keep`` is less than 1 (before anything is written).
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    rank, world_size = _rank_and_world()
    rng = _rng_state()
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + ".tmp")
    run_on_rank0(lambda: _fresh_folder(tmp))

    stateless = not optimizer.state
    dcp.save(_state_dict(model, optimizer, model_only=stateless), checkpoint_id=tmp)
    torch.save(rng, _rng_file(tmp, rank))
    if rank == 0:
        trainer_state = {
            "step": step,
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "extra": dict(extra or {}),
            "world_size": world_size,
            # Without per-parameter state, the plain state dict is only hyperparameters (lr, ...): tiny.
            "optimizer": optimizer.state_dict() if stateless else None,
        }
        torch.save(trainer_state, tmp / TRAINER_STATE)
    if world_size > 1:
        dist.barrier()  # every rank's files are written
    if delay := float(os.environ.get(TEST_SAVE_DELAY_ENV) or 0):
        time.sleep(delay)  # test-only: a window to kill the run between writing and committing
    run_on_rank0(lambda: _commit(tmp, final, step, world_size, keep))
    _set_rng_state(rng)
    return final


def _complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest step first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if (match := _NAME.match(child.name)) and (child / MARKER).is_file():
            found.append((int(match[1]), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``; None if there is none (or no ``root``).

    ``.tmp`` folders (a save in progress or crashed) and folders without the marker are ignored.
    """
    complete = _complete_checkpoints(Path(root))
    return complete[-1] if complete else None


def _restore_rng(path: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """This rank's saved RNG states at the same world size; rank 0's on every rank otherwise.

    Rank 0's states are what an uninterrupted run at the new size would hold if the recipe seeds every rank
    alike (the usual SPMD rule: TP ranks must draw the same data and DTensor random ops need equal seeds).
    A warning says when the saved ranks' torch states differed, i.e. some per-rank randomness is lost.
    """
    if world_size == saved_world_size:
        _set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
        return
    first = torch.load(_rng_file(path, 0), weights_only=False)
    if rank == 0:
        others = (torch.load(_rng_file(path, r), weights_only=False) for r in range(1, saved_world_size))
        if any(not torch.equal(other["torch"], first["torch"]) for other in others):
            warnings.warn(
                f"{path} was saved by {saved_world_size} ranks with different RNG states and is loaded by "
                f"{world_size}: every rank continues from rank 0's states",
                stacklevel=3,
            )
    _set_rng_state(first)


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None
) -> dict[str, Any]:
    """Restore a checkpoint into a freshly built (and parallelised) model, its optimizer and scheduler.

    Collective. The model may be parallelised differently from the one saved (another tp, dp or world
    size): DCP reads each rank's shards of every parameter and optimizer tensor by global offsets. RNG
    states: see :func:`_restore_rng`. Returns ``{"step": step, **extra}``.

    The small files are pickles (``extra`` may hold any object): load only checkpoints you trust.

    Raises:
        FileNotFoundError: If ``path`` is not a complete checkpoint (missing, ``.tmp``, or no marker).
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    rank, world_size = _rank_and_world()
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
    state = _state_dict(model, optimizer, model_only=trainer_state["optimizer"] is not None)
    dcp.load(state, checkpoint_id=path)
    if "optim" in state:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS
        )
    else:
        set_model_state_dict(model, state["model"], options=_OPTIONS)
        optimizer.load_state_dict(trainer_state["optimizer"])
    if scheduler is not None and trainer_state["scheduler"] is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])
    _restore_rng(path, rank, world_size, trainer_state["world_size"])
    return {"step": trainer_state["step"], **trainer_state["extra"]}
