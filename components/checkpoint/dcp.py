"""Sharded, atomic training checkpoints with ``torch.distributed.checkpoint`` (DCP): save and
resume.

One checkpoint is the folder ``root/step_00000042/`` (layout and checks: :mod:`integrity`): DCP's
``.metadata`` and ``__<rank>_0.distcp`` (model and optimizer state by global shape, so a load at
another tp or dp size reshards them), ``trainer_state.json``, one ``rng/rank_NNNNN.json`` per rank
and the ``COMPLETE`` marker.

Atomicity: every rank writes into ``step_00000042.tmp``; rank 0 then writes the marker and renames
the folder (one ``os.replace``). A crash leaves a ``.tmp`` folder that resume never picks. Pruning
(``keep``) removes only older checkpoints of the same run id.

Design notes: docs/design-notes.md
"""

import base64
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from components.checkpoint.integrity import (
    MARKER,
    RNG_DIR,
    STATE_FORMAT,
    TRAINER_STATE,
    check_checkpoint,
    checkpoint_path,
    complete_checkpoints,
    read_trainer_state,
    rng_file,
)
from components.checkpoint.manifest import foreign_files, write_manifest
from components.checkpoint.safe_dcp import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_error_in,
    dumps_state,
    loads_state,
)

__all__ = ["MARKER", "CheckpointError", "checkpoint_path", "load_checkpoint", "save_checkpoint"]

# Optimizer state and hyperparameters keyed by parameter name ("optim.state.<fqn>.exp_avg",
# "optim.param_groups.<fqn>.lr"), so a load does not depend on param-group order. The unflattened
# layout reshards across tp/dp just as well (measured); this one is what torchtitan uses.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_on_rank0(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 only; every rank returns after it has finished, and every rank
    raises if it failed (rank 0 its own exception, the others a RuntimeError quoting it), so no rank
    is left waiting."""
    rank, world = rank_and_world()
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


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(state["numpy"])


def _bytes_of(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _tensor_of(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_to_json(state: dict[str, Any]) -> str:
    name, keys, position, has_gauss, cached = state["numpy"]
    plain = {
        "torch": _bytes_of(state["torch"]),
        "python": state["python"],
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
    }
    if "cuda" in state:
        plain["cuda"] = _bytes_of(state["cuda"])
    return dumps_state(plain)


def _rng_from_json(text: str) -> dict[str, Any]:
    plain = loads_state(text)
    name, keys, position, has_gauss, cached = plain["numpy"]
    state = {
        "torch": _tensor_of(plain["torch"]),
        "python": plain["python"],
        "numpy": (name, np.array(keys, dtype=np.uint32), position, has_gauss, cached),
    }
    if "cuda" in plain:
        state["cuda"] = _tensor_of(plain["cuda"])
    return state


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


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def publish_folder(tmp: Path, final: Path) -> None:
    """Atomically put the finished folder ``tmp`` at ``final``; an existing ``final`` is moved aside
    first, then removed, so a crash at any point leaves one complete folder (old or new) under a
    known name.

    ``tmp`` gets a manifest of its files (:func:`components.checkpoint.manifest.write_manifest`).

    Raises:
        FileExistsError: If ``final`` holds files that no earlier publish wrote (a user's own
            files), before anything is moved; the message names them.
    """
    if final.exists() and (foreign := foreign_files(final)):
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise FileExistsError(
            f"{final} holds files shardtune did not write ({shown}); move them or choose another "
            "folder"
        )
    write_manifest(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_folder(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _run_id_of(folder: Path) -> str | None:
    try:
        return read_trainer_state(folder)["run_id"]
    except CheckpointError:
        return None


def _commit(
    tmp: Path, final: Path, step: int, world_size: int, keep: int | None, run_id: str | None
) -> None:
    """Mark ``tmp`` complete, rename it to ``final`` (replacing an older save of the same step), and
    prune this run's older checkpoints down to ``keep``."""
    _write_synced(tmp / MARKER, json.dumps({"step": step, "world_size": world_size}))
    publish_folder(tmp, final)
    if keep is not None:
        ours = [
            path
            for path in complete_checkpoints(final.parent)
            if path != final and _run_id_of(path) == run_id
        ]
        for path in ours[: max(0, len(ours) - (keep - 1))]:
            shutil.rmtree(path)


def _state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_only: bool
) -> dict[str, Any]:
    """What DCP saves or loads in place: the model's, and unless ``model_only`` the optimizer's,
    state.

    ``model_only`` is for an optimizer without per-parameter state (never stepped, or stateless like
    plain SGD): ``get_state_dict`` would create state by running a step with zero grads and lr 0,
    which for AdamW counts as step 1 and so changes the run. Its hyperparameters travel in
    ``trainer_state.json``.
    """
    if model_only:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_state, "optim": optimizer_state}


def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's settings (lr, momentum, weight decay, ...) per param group, without the
    group's parameters: what every rank holds alike in any layout, where a pipeline stage's group
    lists only that stage's parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _apply_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Put ``settings`` (one per param group, as :func:`_settings` gives them; a ``params`` entry,
    which checkpoints before this layout-free form held, is ignored) into ``optimizer``'s groups."""
    for group, setting in zip(optimizer.param_groups, settings, strict=True):
        group.update({k: v for k, v in setting.items() if k != "params"})


def _numbers(state: Any) -> Any:
    """``state`` with each one-value tensor as its number: torchao's optimizers keep their learning
    rates as host tensors, which the schedule's state and the settings then hold too."""
    if isinstance(state, torch.Tensor) and state.numel() == 1:
        return state.item()
    if isinstance(state, dict):
        return {key: _numbers(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_numbers(value) for value in state)
    return state


def _trainer_state_text(step, optimizer, scheduler, extra, world_size, run_id, run_info) -> str:
    stateless = not optimizer.state
    return dumps_state(
        {
            "format": STATE_FORMAT,
            "step": step,
            "world_size": world_size,
            "run_id": run_id,
            "run_info": dict(run_info or {}),
            "scheduler": None if scheduler is None else _numbers(scheduler.state_dict()),
            "extra": dict(extra or {}),
            # Without per-parameter state, the optimizer is only its settings (lr, ...): tiny, and
            # without parameter indices, which differ between pipeline stages and layouts.
            "optimizer": {"param_groups": _numbers(_settings(optimizer))} if stateless else None,
        }
    )


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    *,
    run_id: str | None = None,
    run_info: dict[str, Any] | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Save model, optimizer, scheduler, ``step``, ``extra`` and every rank's RNG states; return the
    folder.

    Collective: every rank calls it with the same arguments. ``extra`` (JSON-able: dicts, lists,
    tuples, numbers, strings, e.g. the data position) comes back from :func:`load_checkpoint`.
    ``run_id`` and ``run_info`` (JSON-able; what a resume must match: model fingerprint, optimizer,
    batch geometry, ...) are recorded for
    :func:`components.checkpoint.integrity.checkpoint_summary`. With ``keep``, only the newest
    ``keep`` complete checkpoints of this ``run_id`` under ``root`` survive (this one always does);
    checkpoints of other runs are never touched. ``before_commit(tmp_folder)`` runs on every rank
    after all ranks wrote their files and before the marker and rename (a caller's hook, e.g. the
    ``slow_save`` drill of :mod:`components.debug.faults`; one that raises on some ranks only leaves
    the others waiting until the collective timeout). The RNG
    states are those at the call, and the call leaves them as it found them, so saving does not
    perturb the run.

    Raises:
        ValueError: If ``keep`` is less than 1 or given without ``run_id`` (before anything is
            written).
        TypeError: If the scheduler state, ``extra`` or ``run_info`` hold values JSON cannot store.
    """
    save, state = start_save(root, step, model, optimizer, scheduler, extra, keep, run_id, run_info)
    dcp.save(state, checkpoint_id=save.tmp)
    set_rng_state(save.rng)
    return end_save(save, before_commit)


@dataclass(frozen=True, kw_only=True)
class PendingSave:
    """A save between :func:`start_save` and :func:`end_save`: its folders, step and RNG states."""

    tmp: Path
    final: Path
    step: int
    world_size: int
    keep: int | None
    run_id: str | None
    rng: dict[str, Any]


def start_save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    extra: dict[str, Any] | None,
    keep: int | None,
    run_id: str | None,
    run_info: dict[str, Any] | None,
) -> tuple[PendingSave, dict[str, Any]]:
    """The first part of :func:`save_checkpoint` (collective): a fresh ``.tmp`` folder holding the
    RNG and trainer states; returns the save and the state dict for DCP to write into
    ``save.tmp``."""
    if keep is not None and (keep < 1 or run_id is None):
        raise ValueError(
            "keep must be at least 1 and needs a run_id (pruning touches only this run's), got "
            f"{keep}"
        )
    rank, world_size = rank_and_world()
    state_text = _trainer_state_text(
        step, optimizer, scheduler, extra, world_size, run_id, run_info
    )
    rng = _rng_state()
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + ".tmp")
    run_on_rank0(lambda: _fresh_folder(tmp))
    _write_synced(rng_file(tmp, rank), _rng_to_json(rng))
    if rank == 0:
        _write_synced(tmp / TRAINER_STATE, state_text)
    save = PendingSave(
        tmp=tmp, final=final, step=step, world_size=world_size, keep=keep, run_id=run_id, rng=rng
    )
    return save, _state_dict(model, optimizer, model_only=not optimizer.state)


def end_save(save: PendingSave, before_commit: Callable[[Path], None] | None = None) -> Path:
    """The last part of :func:`save_checkpoint` (collective), once DCP has written ``save.tmp`` on
    every rank: the ``before_commit`` hook, the marker, the rename and the pruning; returns the
    folder."""
    if save.world_size > 1:
        dist.barrier()  # every rank's files are written
    if before_commit is not None:
        before_commit(save.tmp)
    run_on_rank0(
        lambda: _commit(save.tmp, save.final, save.step, save.world_size, save.keep, save.run_id)
    )
    return save.final


def _restore_rng(path: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """This rank's saved RNG states at the same world size; rank 0's on every rank otherwise.

    Rank 0's states are what an uninterrupted run at the new size would hold if the recipe seeds
    every rank alike (the usual SPMD rule: TP ranks must draw the same data and DTensor random ops
    need equal seeds). A warning says when the saved ranks' torch states differed, i.e. some
    per-rank randomness is lost.
    """
    if world_size == saved_world_size:
        set_rng_state(_rng_from_json(rng_file(path, rank).read_text()))
        return
    first = _rng_from_json(rng_file(path, 0).read_text())
    if rank == 0:
        others = (_rng_from_json(rng_file(path, r).read_text()) for r in range(1, saved_world_size))
        if any(not torch.equal(other["torch"], first["torch"]) for other in others):
            warnings.warn(
                f"{path} was saved by {saved_world_size} ranks with different RNG states and is "
                "loaded by "
                f"{world_size}: every rank continues from rank 0's states",
                stacklevel=3,
            )
    set_rng_state(first)


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None
) -> dict[str, Any]:
    """Restore a checkpoint into a freshly built (and parallelised) model, its optimizer and
    scheduler.

    Collective. The model may be parallelised differently from the one saved (another tp, dp or
    world size): DCP reads each rank's shards of every parameter and optimizer tensor by global
    offsets. With a ``scheduler``, the optimizer's settings (lr, weight decay, ...) and the schedule
    stay this run's from the checkpoint's step on (:func:`_continue_schedule`). RNG states: see
    :func:`_restore_rng`. Returns ``{"step": step, **extra}``. Runs no code from the checkpoint.

    Raises:
        CheckpointError: ``checkpoint <path> is unusable: <cause>`` if the folder fails
            :func:`~components.checkpoint.integrity.check_checkpoint` (missing, ``.tmp``, no marker,
            damaged or hostile files), or DCP finds a value that is not plain data.
    """
    path = Path(path)
    check_checkpoint(path)
    rank, world_size = rank_and_world()
    trainer_state = read_trainer_state(path)
    state = _state_dict(model, optimizer, model_only=trainer_state["optimizer"] is not None)
    # this run's optimizer settings (optim.lr, weight_decay, ...): the loaded groups carry the saved
    settings = _settings(optimizer)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except (
        CheckpointError,
        CheckpointException,
    ) as error:  # DCP's CheckpointException is a BaseException
        if (cause := checkpoint_error_in(error)) is None:
            raise
        raise CheckpointError(f"checkpoint {path} is unusable: {cause}") from None
    if "optim" in state:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_OPTIONS,
        )
    else:
        set_model_state_dict(model, state["model"], options=_OPTIONS)
        _apply_settings(optimizer, trainer_state["optimizer"]["param_groups"])
    if scheduler is not None and trainer_state["scheduler"] is not None:
        _apply_settings(optimizer, settings)
        _continue_schedule(scheduler, trainer_state["scheduler"])  # at its step, on this schedule
    _restore_rng(path, rank, world_size, trainer_state["world_size"])
    return {**trainer_state["extra"], "step": trainer_state["step"]}  # the cross-checked step


def _continue_schedule(scheduler: LRScheduler, saved: dict[str, Any]) -> None:
    """Put a freshly built ``scheduler`` at the step a checkpoint's scheduler (its ``state_dict``,
    ``saved``) had reached, and its optimizer's learning rates at this run's schedule there.

    Only the position comes from the checkpoint, not its base learning rates (``load_state_dict``
    would restore those and keep the saved lr for one step), so a changed lr, schedule, warmup or
    run length applies from the resumed step on; an unchanged one gives the saved learning rates
    exactly (the ``base_lr * factor(step)`` a ``LambdaLR`` step computes). Every schedule of
    ``components.training.schedule`` is a ``LambdaLR``.
    """
    if not isinstance(scheduler, LambdaLR):
        scheduler.load_state_dict(saved)  # another scheduler: its own state, as saved
        return
    step = saved["last_epoch"]
    schedule = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    rates = [base * factor(step) for base, factor in schedule]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers step with a tensor lr
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    scheduler.last_epoch, scheduler._step_count = step, saved["_step_count"]
    scheduler._last_lr = rates
