"""From a checked config to running ranks: the ``prepare`` phase once (here, or on rank 0 of a
torchrun world while the others wait for its plan), then the ranks, here (torchrun started us) or
as local processes with torch elastic's restarts.

Design notes: docs/design-notes.md
"""

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from components.runtime.exit_status import STOPPED_STATUS, AlreadyComplete
from components.runtime.launch import ReportedExit, launch_local, under_torchrun
from components.runtime.startup import started_by_launcher
from components.runtime.world import join_world

Plan = TypeVar("Plan")
Checked = Any  # what a recipe's checks return: its device, timeout, threads, seed, dry_run


def prepare_once(prepare: Callable[[Checked], tuple[Plan, Any]], checked: Checked):
    """``prepare(checked)``'s (plan, handle), made once: in this process, or under torchrun on rank
    0 alone, whose plan every other rank receives (with a handle of None). There the world is
    joined first (unless ``checked.dry_run``), with the checked device, timeout, threads and seed,
    so that the other ranks can wait for rank 0's plan. When rank 0 fails, the others exit quietly
    with status 2 (0 when the run is already complete): rank 0 says why."""
    if started_by_launcher() and not checked.dry_run:
        join_world(
            checked.device_type,
            checked.collective_timeout,
            checked.cpu_threads,
            checked.seed,
            checked.settings.train.tf32,
        )
    if not dist.is_initialized():
        return prepare(checked)
    if dist.get_rank() == 0:
        try:
            plan, handle = prepare(checked)
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
    hang_timeout_s: float | None = None,
) -> None:
    """Run ``rank_main(plan)`` on every rank: this process's alone under torchrun (a stopped rank
    exits 0 there: another status would restart it), else ``world_size`` local ranks with up to
    ``max_restarts`` restarts (a restarted rank finds its attempt in :func:`local_restart`), and a
    rank whose heartbeat shows no progress for ``hang_timeout_s`` ended as a failure. A rank's
    non-None result (the signal that stopped it, with a checkpoint) ends the launcher with
    :data:`STOPPED_STATUS`."""
    if started_by_launcher():
        rank_main(plan)
        return
    results = launch_local(
        rank_main, world_size, plan, max_restarts=max_restarts, hang_timeout_s=hang_timeout_s
    )
    if any(results.values()):
        raise SystemExit(STOPPED_STATUS)


def local_restart() -> int:
    """In a rank :func:`run_ranks` started here: which restart this is (0: the first attempt);
    0 under torchrun, where a restart runs the whole command again."""
    if under_torchrun():
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
