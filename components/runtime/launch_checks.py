"""What the launch itself decides before any rank starts, for the recipe's checks: a GPU for each
local rank on CUDA; the keys torchrun, which starts and restarts the ranks itself, does not read."""

import os

from components.problems import Problem
from components.runtime.launch import started_by_launcher


def gpu_count_problems(world_size: int, gpus: int) -> list[Problem]:
    """On CUDA every local rank has a GPU of its own (``LOCAL_RANK`` picks it)."""
    local = int(os.environ["LOCAL_WORLD_SIZE"]) if started_by_launcher() else world_size
    if local <= gpus:
        return []
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
    key = "nproc" if not started_by_launcher() else "LOCAL_WORLD_SIZE"
    message = (
        f"{local} ranks on this machine need a GPU each but {gpus} "
        f"{'is' if gpus == 1 else 'are'} visible{where}: use nproc={gpus} or fewer (with dp, cp "
        "and tp to match), or torchrun across machines"
    )
    return [Problem(key=key, message=message)]


def torchrun_unread_keys(nproc: int | None, max_restarts: int) -> list[str]:
    """``nproc`` and ``max_restarts`` set under torchrun, which decides both itself: one line
    each (none outside torchrun)."""
    unread = []
    if not started_by_launcher():
        return unread
    if nproc is not None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "?")
        started = f"torchrun started {local} ranks here (its --nproc-per-node)"
        unread.append(f"nproc={nproc} is not read under torchrun: {started}")
    if max_restarts:
        theirs = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        unread.append(
            f"max_restarts={max_restarts} is the recipe's own launcher's and is not read under "
            f"torchrun, which restarts the ranks itself (here --max-restarts={theirs}): pass "
            f"--max-restarts={max_restarts} to torchrun"
        )
    return unread
