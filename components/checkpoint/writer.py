"""The run's checkpoint writer: each save blocking the step (``checkpoint.async=false``), or written
in the background with DCP's ``async_save`` (``checkpoint.async=true``) while training goes on.

An async save copies the state to CPU memory (one stager for the run, whose host buffers, pinned
on CUDA, every save reuses), then a thread writes ``step_N.tmp`` over a gloo process group of its
own; at most one save is in flight. The publish (marker, rename, pruning;
:func:`components.checkpoint.dcp.end_save`) runs on the training thread once every rank's write has
finished, so a crash during an async save leaves the previous checkpoint whole.

Once per step every rank's stop request and save state are MAX-reduced with the step's other
values (:meth:`CheckpointWriter.step_flags`, then :meth:`CheckpointWriter.agree`): every rank stops
and publishes after the same step, and a save that failed on one rank fails the run on all. The
training thread's time here is the next step's ``checkpoint_stall_s`` (:meth:`~.take_stall`).

Design notes: docs/design-notes.md
"""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from components.checkpoint.dcp import (
    PendingSave,
    end_save,
    save_checkpoint,
    set_rng_state,
    start_save,
)
from components.checkpoint.state import TrainState

_WRITTEN, _WRITING, _FAILED = 0, 1, 2


class CheckpointWriter:
    """Saves of one run under ``root`` (``keep``, ``run_id``, ``run_info``: see
    ``save_checkpoint``).

    Collective: every rank builds one (after the process group exists) and calls every method alike.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int | None,
        run_id: str | None,
        run_info: dict[str, Any] | None,
        asynchronous: bool,
        before_commit: Callable[[Path], None] | None = None,
    ) -> None:
        self.root, self.keep, self.run_id, self.run_info = root, keep, run_id, run_info
        self.asynchronous, self.before_commit = asynchronous, before_commit
        self.last_step: int | None = None  # the step of the latest save started
        self.last_path: Path | None = None  # the latest checkpoint published
        self.stop_asked = False  # whether any rank was asked to stop, as last agreed
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo") if asynchronous and distributed else None
        self._pending: tuple[PendingSave, Future] | None = None
        self._stager: DefaultStager | None = None  # made at the first async save, for its device
        self._stalled = 0.0  # seconds the training thread spent here since take_stall
        self._inside = 0  # nested _stalling blocks: only the outermost counts

    @contextmanager
    def _stalling(self) -> Iterator[None]:
        started, self._inside = time.perf_counter(), self._inside + 1
        try:
            yield
        finally:
            self._inside -= 1
            if not self._inside:
                self._stalled += time.perf_counter() - started

    def take_stall(self) -> dict[str, float]:
        """``{"checkpoint_stall_s": seconds}`` the training thread spent saving since the last call
        (a save after a step, its copy to the host, waiting for the previous one, the publish);
        empty when it spent none."""
        stalled, self._stalled = self._stalled, 0.0
        return {"checkpoint_stall_s": stalled} if stalled else {}

    def save(self, state: TrainState) -> None:
        """Save ``state`` at its step: at once, or (async) start writing it once the previous save
        is published."""
        with self._stalling():
            extra = None if state.stream is None else {"data": state.stream.state_dict()}
            self._save(state.step, state.model, state.optimizer, state.schedule, extra)

    def _save(self, step: int, model: nn.Module, optimizer, scheduler, extra: dict | None) -> None:
        self.wait()
        if self.asynchronous and self._stager is None:
            self._stager = host_stager(next(model.parameters()).device.type)
        self.last_step = step
        ids = dict(keep=self.keep, run_id=self.run_id, run_info=self.run_info)
        if not self.asynchronous:
            self.last_path = save_checkpoint(
                self.root,
                step,
                model,
                optimizer,
                scheduler,
                extra,
                **ids,
                before_commit=self.before_commit,
            )
            return
        pending, state = start_save(self.root, step, model, optimizer, scheduler, extra, **ids)
        response = dcp.async_save(
            state, checkpoint_id=pending.tmp, process_group=self._group, async_stager=self._stager
        )
        future = getattr(
            response, "upload_completion", response
        )  # an AsyncSaveResponse when staging is async
        set_rng_state(pending.rng)  # as save_checkpoint: saving leaves the RNG states as they were
        self._pending = (pending, future)

    @property
    def in_flight(self) -> bool:
        """True while an async save has not been published."""
        return self._pending is not None

    def step_flags(self, stop_requested: bool) -> list[float]:
        """This rank's flags after a step: [asked to stop, the state of its save in flight], to be
        reduced by MAX over every rank (with the step's other values: one collective, one read)
        and handed to :meth:`agree`."""
        return [float(stop_requested), float(self._state(block=False))]

    def agree(self, flags: list[float]) -> bool:
        """Act on the flags every rank agreed (:meth:`step_flags`, MAX-reduced): publish the save in
        flight if every rank has written it, fail if one failed; keep and return whether any rank
        was asked to stop (``stop_asked``, the same on every rank)."""
        self._settle(int(flags[1]))
        self.stop_asked = bool(flags[0])
        return self.stop_asked

    def after_step(self, stop_requested: bool) -> bool:
        """Once per step on every rank, for a loop without a step readout: :meth:`step_flags`
        all-reduced on their own, then :meth:`agree`."""
        flags = torch.tensor(self.step_flags(stop_requested), dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return self.agree(flags.tolist())

    def wait(self) -> None:
        """Wait for the save in flight (if any) on every rank and publish it (collective)."""
        if not self.asynchronous:
            return
        with self._stalling():
            self._wait()

    def close(self) -> None:
        """:meth:`wait`, then free the stager's host buffers (collective)."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _wait(self) -> None:
        state = torch.tensor([float(self._state(block=True))], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
        self._settle(int(state.item()))

    def _state(self, block: bool) -> int:
        if self._pending is None:
            return _WRITTEN
        future = self._pending[1]
        if block:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - reported by _settle on every rank
                return _FAILED
        if not future.done():
            return _WRITING
        return _FAILED if future.exception() is not None else _WRITTEN

    def _settle(self, state: int) -> None:
        """Act on the state agreed by all ranks: publish, keep waiting, or fail."""
        if self._pending is None or state == _WRITING:
            return
        pending, future = self._pending
        self._pending = None
        if state == _FAILED:
            error = future.exception() if future.done() else None
            raise RuntimeError(
                f"the async save of step {pending.step} failed on a rank: {error}"
            ) from error
        with self._stalling():
            self.last_path = end_save(pending, self.before_commit)


def host_stager(device_type: str) -> DefaultStager:
    """DCP's stager for state on ``device_type``, copying on the training thread (the next step may
    change the weights) into host buffers it keeps for the next save; from CUDA pinned ones, filled
    by non-blocking copies and one sync."""
    cuda = device_type == "cuda"
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,  # the writing thread shares this process's memory
        use_async_staging=False,
        use_non_blocking_copy=cuda,
    )
    return DefaultStager(options)
