"""From a checked config to running ranks, each step a call the recipe makes: join a torchrun
world (:func:`join_launched_world`), prepare once (here, or on rank 0 of a torchrun world:
:func:`prepares_here`, :func:`failure_told_to_waiting_ranks`) and share the plan
(:func:`shared_plan`), then the ranks (:func:`run_ranks`), here (torchrun started us) or as local
processes with torch elastic's restarts.

Design notes: docs/design-notes.md
"""

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from components.runtime.exit_status import STOPPED_STATUS, AlreadyComplete
from components.runtime.launch import (
    ReportedExit,
    failure_named_by_this_rank,
    launch_local,
    under_torchrun,
)
from components.runtime.startup import started_by_launcher
from components.runtime.world import join_world

Plan = TypeVar("Plan")
Checked = Any  # what a recipe's checks return: its device, timeout, threads, seed, dry_run


def join_launched_world(checked: Checked) -> None:
    """Under torchrun (and not a dry run): join the world now, with the checked device, timeout,
    threads and seed, so that rank 0 can prepare the run for all while the others wait for its
    plan (:func:`shared_plan`). Elsewhere: nothing (the local launcher prepares before it forks)."""
    if started_by_launcher() and not checked.dry_run:
        join_world(
            checked.device_type,
            checked.collective_timeout,
            checked.cpu_threads,
            checked.seed,
            checked.settings.train.tf32,
        )


def prepares_here() -> bool:
    """Whether this process prepares the run: every process outside torchrun, rank 0 in it."""
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def failure_told_to_waiting_ranks() -> Iterator[None]:
    """Around rank 0's preparation in a torchrun world: when it fails, the ranks waiting in
    :func:`shared_plan` receive its exit status instead of a plan (0 when the run is already
    complete, else 2) and exit quietly with it, while rank 0 says why. Elsewhere: nothing."""
    try:
        yield
    except BaseException as error:
        if dist.is_initialized() and dist.get_rank() == 0:
            dist.broadcast_object_list([0 if isinstance(error, AlreadyComplete) else 2], src=0)
        raise


def shared_plan(plan: Plan | None) -> Plan:
    """Rank 0's plan on every rank of a torchrun world (this process's own outside one). A rank
    whose rank 0 failed to prepare exits with rank 0's status (sent by
    :func:`failure_told_to_waiting_ranks`). The wait is a collective: it gives up after the
    checked collective timeout."""
    if not dist.is_initialized():
        return plan
    sent = [plan if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if isinstance(sent[0], int):  # rank 0's exit status: no plan
        raise ReportedExit(sent[0])
    return sent[0]


def run_ranks(
    rank_main: Callable[[Plan], str | None],
    plan: Plan,
    world_size: int,
    max_restarts: int = 0,
    hang_timeout_s: float | None = None,
) -> None:
    """Run ``rank_main(plan)`` on every rank: this process's alone under torchrun (a stopped rank
    exits 0 there: another status would restart it; a failed one prints its own ``error:`` line),
    else ``world_size`` local ranks with up to
    ``max_restarts`` restarts (a restarted rank finds its attempt in :func:`local_restart`), and a
    rank whose heartbeat shows no progress for ``hang_timeout_s`` ended as a failure. A rank's
    non-None result (the signal that stopped it, with a checkpoint) ends the launcher with
    :data:`STOPPED_STATUS`."""
    if started_by_launcher():
        with failure_named_by_this_rank():
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
