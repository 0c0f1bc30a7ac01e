"""Deliberate faults for resilience drills, switched on by ``debug.fault``: a run that proves the
safeguards catch them, on a user's own cluster as in this project's tests (docs/fault-injection.md).

- ``nan_grad@N``: after the backward of step N, rank 0 writes NaN into one gradient.
- ``perturb_replica@N``: after the update of step N, the last rank nudges its copy of one
  TP-replicated parameter (replica drift).
- ``raise@N``: the last rank raises at the start of step N (a crash on one rank mid-run).
- ``replica_sync_sum``: every replicated parameter is sum-reduced instead of mean-reduced.
- ``slow_save@S``: every checkpoint save waits S seconds before it is committed.
- ``kill@N``, ``kill_in_collective@N``, ``kill_in_save@N``: in its run's first attempt only, the
  last rank SIGKILLs itself in step N: at its forward, in a collective (gloo only), in its save.
- ``stop@N``: in the first attempt, the last rank SIGSTOPs itself at its first forward of step N.

:func:`install_faults` installs one through the model's, optimizer's and checkpoint writer's hooks,
only in a run that asks for it. Steps count training forwards (a skipped update shifts nothing).
"""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from components.distributed.tp_replicas import (
    mark_tp_replica_gradient_reduction,
    tp_replica_reduction,
    unmarked_parameters,
)

_KILLS = ("kill", "kill_in_collective", "kill_in_save", "stop")
KINDS = ("nan_grad", "perturb_replica", "raise", "replica_sync_sum", "slow_save", *_KILLS)
_WITH_STEP = ("nan_grad", "perturb_replica", "raise", "slow_save", *_KILLS)
# How long the other ranks arrive late at step N of kill_in_collective, so that the last rank is
# surely waiting in the collective when it dies.
_LATE_S = 1.0


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    step: int | None = None  # the step it strikes at (seconds for slow_save)


def parse_fault(text: str | None) -> Fault | None:
    """``"nan_grad@3"`` -> Fault("nan_grad", 3); None -> None; anything else -> ValueError naming
    the key."""
    if text is None:
        return None
    kind, _, step = str(text).partition("@")
    needs_step = kind in _WITH_STEP
    if kind not in KINDS or needs_step != step.isdigit() or (step.isdigit() and int(step) < 1):
        raise ValueError(
            f"debug.fault={text!r} is not a known fault: use nan_grad@STEP, perturb_replica@STEP, "
            "raise@STEP, slow_save@SECONDS, kill@STEP, kill_in_collective@STEP, kill_in_save@STEP, "
            "stop@STEP or replica_sync_sum"
        )
    return Fault(kind=kind, step=int(step) if step else None)


# Faults that only strike as described over gloo: on NCCL a collective returns before its peers
# arrive (the rank then waits in a CUDA sync, not in ``wait_tensor``).
GLOO_ONLY = ("kill_in_collective",)


def fault_backend_errors(fault: Fault | None, device_type: str) -> list[str]:
    """Why ``fault`` cannot run on ``device_type``'s backend (NCCL on CUDA), if it cannot."""
    if fault is None or fault.kind not in GLOO_ONLY or device_type == "cpu":
        return []
    return [
        f"debug.fault={fault.kind}@{fault.step} is gloo-only (a CPU run): on NCCL a rank never "
        f"waits in wait_tensor; use kill@{fault.step} or kill_in_save@{fault.step} on CUDA"
    ]


# Faults on TP replicas: at tp=1 there are none, and the drill would change nothing.
TP_ONLY = ("perturb_replica", "replica_sync_sum")


def fault_layout_errors(fault: Fault | None, tp: int) -> list[str]:
    """Why ``fault`` cannot strike at this ``tp``, if it cannot."""
    if fault is None or fault.kind not in TP_ONLY or tp > 1:
        return []
    asked = f"{fault.kind}@{fault.step}" if fault.step else fault.kind
    return [
        f"debug.fault={asked} needs tp > 1: it acts on TP replicas, and at tp=1 there are none "
        "(the drill would change nothing); use e.g. tp=2"
    ]


def _first_replicated(model: nn.Module) -> torch.Tensor:
    """The first TP-replicated parameter this rank holds a part of: a plain tensor, or under FSDP
    (dp or cp > 1) a DTensor whose local shard is that part."""
    for _, parameter, _ in unmarked_parameters([model]):
        if _tp_replicated(parameter) and _local(parameter).numel():
            return parameter
    raise RuntimeError("no replicated parameter on this rank to inject a fault into")


def _tp_replicated(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is the same on every TP rank (not a TP shard; FSDP may shard it)."""
    if not isinstance(parameter, DTensor):
        return True
    names = parameter.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(parameter.placements[names.index("tp")], Replicate)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, in place: a DTensor's local shard."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _StepCounter:
    """The 1-based step a training forward belongs to, from the count of training forwards so
    far."""

    def __init__(self, model: nn.Module, first_step: int, micro_batches_per_step: int) -> None:
        self.forwards, self.first_step, self.per_step = 0, first_step, micro_batches_per_step
        model.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args) -> None:
        if module.training:
            self.forwards += 1

    @property
    def step(self) -> int:
        """The step of the latest training forward."""
        return self.first_step + (self.forwards - 1) // self.per_step + 1

    @property
    def last_micro_batch(self) -> bool:
        return self.forwards % self.per_step == 0


def install_faults(
    fault: Fault,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    first_step: int,
    micro_batches_per_step: int,
) -> Callable[[Path], None] | None:
    """Install ``fault`` on ``model``/``optimizer``; returns the checkpoint writer's
    ``before_commit`` callback (``slow_save``) or None. Call once, after the model is sharded and
    before its replicas are broadcast."""
    if fault.kind == "slow_save":
        return lambda folder: time.sleep(fault.step)
    if fault.kind == "replica_sync_sum":
        for module in model.modules():
            if tp_replica_reduction(module) != "skip":
                mark_tp_replica_gradient_reduction(module, "sum")
        return None
    counter = _StepCounter(model, first_step, micro_batches_per_step)
    last = rank == world_size - 1
    if fault.kind in _KILLS:
        _kill_at(fault, model, counter, last)
    elif fault.kind == "raise" and last:
        _crash_at(fault.step, model, counter)
    elif fault.kind == "nan_grad" and rank == 0:
        _poison_at(fault.step, model, counter)
    elif fault.kind == "perturb_replica" and last:
        _nudge_at(fault.step, model, optimizer, counter)
    return None


def _crash_at(step: int, model: nn.Module, counter: _StepCounter) -> None:
    """Raise in the first training forward of ``step``."""

    def crash(module: nn.Module, args) -> None:
        if module.training and counter.step == step:
            raise RuntimeError(f"injected fault (debug.fault=raise@{step})")

    model.register_forward_pre_hook(crash)


def _poison_at(step: int, model: nn.Module, counter: _StepCounter) -> None:
    """A NaN in the first replicated parameter's gradient at the last micro-batch of ``step`` (under
    FSDP, whose reduce-scatter calls the hook too, in the rank's shard of the reduced gradient)."""

    @torch.no_grad()
    def poison(parameter: torch.Tensor) -> None:
        if counter.step == step and counter.last_micro_batch:
            _local(parameter.grad).view(-1)[0] = float("nan")

    _first_replicated(model).register_post_accumulate_grad_hook(poison)


def _nudge_at(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, counter) -> None:
    """Move one replica's first replicated parameter after the optimizer step of ``step``."""

    @torch.no_grad()
    def nudge(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if counter.step == step:
            _local(_first_replicated(model)).view(-1)[0] += 1e-3

    optimizer.register_step_post_hook(nudge)


def _first_attempt() -> bool:
    """Whether this process belongs to its run's first attempt (not one restarted by torch
    elastic)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _die(fault: Fault, where: str, how: signal.Signals = signal.SIGKILL) -> None:
    """SIGKILL (or ``how``) this process, saying so on stderr first (a test reads where)."""
    print(
        f"injected fault (debug.fault={fault.kind}@{fault.step}): {how.name} {where}",
        file=sys.stderr,
    )
    sys.stderr.flush()
    os.kill(os.getpid(), how)


def _kill_at(fault: Fault, model: nn.Module, counter: _StepCounter, last: bool) -> None:
    """The last rank dies in ``fault.step`` as ``fault.kind`` says (first attempt only)."""
    if not _first_attempt():
        return
    step = fault.step

    def at_step(module: nn.Module) -> bool:  # the first training forward of the step
        first_micro_batch = (counter.forwards - 1) % counter.per_step == 0
        return module.training and counter.step == step and first_micro_batch

    armed = threading.Event()

    def before_forward(module: nn.Module, args) -> None:
        if not at_step(module):
            return
        if fault.kind in ("kill", "stop") and last:  # stop: a hung rank, its heartbeat stops
            how = signal.SIGSTOP if fault.kind == "stop" else signal.SIGKILL
            _die(fault, f"at the first forward of step {step}", how)
        elif fault.kind == "kill_in_collective" and last:
            armed.set()  # the watcher kills this rank once it waits in a collective
        elif fault.kind == "kill_in_collective":
            time.sleep(_LATE_S)  # late: the last rank waits for this one in its first collective

    def in_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # a save's state dict after a training step: the save's .tmp folder holds the RNG and
        # trainer states, and DCP has not written a byte of the weights
        if module.training and counter.forwards and counter.step == step:
            _die(fault, f"in the save of step {step}")

    model.register_forward_pre_hook(before_forward)
    if fault.kind == "kill_in_save" and last:
        model.register_state_dict_pre_hook(in_save)
    if fault.kind == "kill_in_collective" and last:
        main = threading.main_thread().ident
        watch = (fault, armed, main)
        threading.Thread(target=_die_in_collective, args=watch, daemon=True).start()


def _die_in_collective(fault: Fault, armed: threading.Event, thread_id: int) -> None:
    """Once ``armed``, SIGKILL this process when thread ``thread_id`` waits in a collective."""
    armed.wait()
    while True:
        frame = sys._current_frames().get(thread_id)
        while frame is not None:
            in_torch = f"torch{os.sep}distributed" in frame.f_code.co_filename
            if in_torch and frame.f_code.co_name in _COLLECTIVE_WAITS:
                _die(fault, f"while waiting in {frame.f_code.co_name} in step {fault.step}")
            frame = frame.f_back
        time.sleep(0.001)


# Where a rank's main thread waits for a collective it has issued: a functional collective's
# result (DTensor's, in the forward). Not the call that issues one (``all_reduce``, ...): a rank
# caught there may not have sent its part yet.
_COLLECTIVE_WAITS = ("wait_tensor",)
