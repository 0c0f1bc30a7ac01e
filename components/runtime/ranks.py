"""From a checked config to running ranks: refusals as one line, the ``prepare`` phase once (here,
or on rank 0 of a torchrun world while the others wait for its plan), then the ranks, here
(torchrun started us) or as local processes with torch elastic's restarts.

Design notes: docs/design-notes.md
"""

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from components.runtime.console import print_line
from components.runtime.exit_status import (
    INTERRUPTED,
    INTERRUPTED_STATUS,
    STOPPED_STATUS,
    AlreadyComplete,
)
from components.runtime.launch import (
    ReportedExit,
    join_world,
    keep_cuda_unstarted,
    launch_local,
    started_by_launcher,
)
from components.runtime.preload import preload
from components.runtime.problems import ConfigError, fail, is_rank_zero, say

Plan = TypeVar("Plan")


@contextmanager
def refusals() -> Iterator[None]:
    """Checking and preparing, before any rank trains: problems end as one ``error:`` line (exit
    2), a run already complete as one ``note:`` line (exit 0), Ctrl-C as one line and status 130,
    no traceback."""
    try:
        yield
    except ConfigError as error:
        fail(error.problems)
    except AlreadyComplete as done:
        say(f"note: {done}")
        raise SystemExit(0) from None
    except KeyboardInterrupt:
        if is_rank_zero():  # under torchrun every rank is interrupted
            print_line(INTERRUPTED, sys.stderr)
        raise SystemExit(INTERRUPTED_STATUS) from None


def prepare_once(prepare: Callable[[], tuple[Plan, Any]]) -> tuple[Plan, Any]:
    """``prepare()``'s (plan, handle) in this process; under torchrun (the world joined) on rank 0
    only, whose plan every other rank receives (with a handle of None). When rank 0 fails, the
    others exit quietly with status 2 (0 when the run is already complete): rank 0 says why."""
    if not dist.is_initialized():
        return prepare()
    if dist.get_rank() == 0:
        try:
            plan, handle = prepare()
        except BaseException as error:
            dist.broadcast_object_list([0 if isinstance(error, AlreadyComplete) else 2], src=0)
            raise
        dist.broadcast_object_list([plan], src=0)
        return plan, handle
    received = [None]
    dist.broadcast_object_list(received, src=0)
    if isinstance(received[0], int):  # rank 0's exit status: no plan
        raise ReportedExit(received[0])
    return received[0], None


def run_ranks(
    rank_main: Callable[[Plan], str | None],
    plan: Plan,
    world_size: int,
    max_restarts: int = 0,
    on_restart: Callable[[Plan, int], Plan] | None = None,
    hang_timeout_s: float | None = None,
) -> None:
    """Run ``rank_main(plan)`` on every rank: this process's alone under torchrun (a stopped rank
    exits 0 there: another status would restart it), else ``world_size`` local ranks with up to
    ``max_restarts`` restarts, each restarted rank's plan made by ``on_restart(plan, attempt)``,
    and a rank whose heartbeat shows no progress for ``hang_timeout_s`` ended as a failure.
    A rank's non-None result (the signal that stopped it, with a checkpoint) ends the launcher with
    :data:`STOPPED_STATUS`."""
    if started_by_launcher():
        rank_main(plan)
        return
    watch = dict(max_restarts=max_restarts, hang_timeout_s=hang_timeout_s)
    results = launch_local(_attempt, world_size, rank_main, on_restart, plan, **watch)
    if any(results.values()):
        raise SystemExit(STOPPED_STATUS)


def _attempt(
    rank_main: Callable[[Plan], str | None],
    on_restart: Callable[[Plan, int], Plan] | None,
    plan: Plan,
) -> str | None:
    """One local rank of one attempt: after a restart (``TORCHELASTIC_RESTART_COUNT`` above 0) its
    plan is made again by ``on_restart``."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt and on_restart is not None:
        plan = on_restart(plan, attempt)
    return rank_main(plan)


def prepared_plan(check: Callable[[], Any], prepare: Callable[[Any], tuple[Plan, Any]]):
    """(plan, handle): ``check()`` (pure, on every process), then ``prepare`` of what it returned,
    once (:func:`prepare_once`): under torchrun the world is joined first, with the checked
    device, timeout, threads and seed, so that the other ranks can wait for rank 0's plan."""
    with refusals():
        checked = check()
        if started_by_launcher() and not checked.dry_run:
            timeout = checked.collective_timeout
            tf32 = checked.settings.train.tf32
            join_world(checked.device_type, timeout, checked.cpu_threads, checked.seed, tf32)
        return prepare_once(lambda: prepare(checked))


def start(
    check: Callable[[], Any],
    prepare: Callable[[Any], tuple[Plan, Any]],
    rank_main: Callable[[Plan], str | None],
    *,
    preload_from: Path,
    dry_run: Callable[[Plan], Any],
    on_restart: Callable[[Plan, int], Plan] | None = None,
) -> None:
    """A recipe's launch: check, prepare once, then ``rank_main`` on every rank (with
    ``plan.dims.world_size`` local ranks, ``plan.settings.max_restarts`` restarts and
    ``plan.settings.hang_timeout_s`` when nothing launched us); a plan with ``dry_run`` set goes to
    ``dry_run`` instead. What the functions of ``preload_from`` import is imported once, before the
    fork. The lock ``prepare`` took on the output folder is released once the ranks are done."""
    keep_cuda_unstarted()  # before the checks import anything that asks torch.cuda
    plan, lock = prepared_plan(check, prepare)
    try:
        if plan.dry_run:
            dry_run(plan)
            return
        preload(preload_from)
        settings = plan.settings
        watch = dict(max_restarts=settings.max_restarts, hang_timeout_s=settings.hang_timeout_s)
        run_ranks(rank_main, plan, plan.dims.world_size, on_restart=on_restart, **watch)
    finally:
        if lock is not None:
            lock.release()
