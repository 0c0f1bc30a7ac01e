"""How a run ends, as a status and one line: stopped by a signal with a checkpoint, interrupted
before any rank started, or failed on a full disk (said plainly, with what survives). Imports
nothing heavy at the top: ``--help`` stays fast."""

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# A SIGTERM or SIGUSR1 stopped the run with a checkpoint: sysexits' EX_TEMPFAIL, "try again later"
# (0: done; 1: an error; 2: bad input; 128 + N: killed by signal N before a checkpoint).
STOPPED_STATUS = 75
# Ctrl-C before any rank started (the checks, tokenizing): 128 + SIGINT, as a shell says it.
INTERRUPTED_STATUS = 130
INTERRUPTED = (
    "error: interrupted (Ctrl-C) before any rank started: nothing was trained or claimed, and the "
    "cache keeps only finished data (its scratch folder was removed)"
)
# Free space below which a failed write is taken for a full disk (torch's checkpoint writer
# reports one as "unexpected pos 704 vs 598", without the errno).
FULL_BYTES = 64 * 2**20


def disk_full(error: BaseException, output_dir: Path) -> str | None:
    """What a write that failed on a full disk under ``output_dir`` says (the folder, the space
    left, the checkpoint that survives), or None when ``error`` is not that."""
    from components.checkpoint.integrity import complete_checkpoints

    chain, cause = [], error
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError:
        return None
    if not (enospc or "No space left on device" in str(error) or free < FULL_BYTES):
        return None
    kept = complete_checkpoints(output_dir / "checkpoints")
    survives = (
        f"the last complete checkpoint, {kept[-1].name}, is kept: free space and "
        "checkpoint.resume=auto continues from it"
        if kept
        else "no checkpoint was written yet: free space and run again"
    )
    return (
        f"no space left on device in {output_dir} ({free / 2**20:.1f} MiB free): {survives}, "
        "or choose an output_dir on another disk"
    )


@contextmanager
def disk_full_said_plainly(output_dir: Path) -> Iterator[None]:
    """Re-raise a write that failed on a full disk as ``OSError(ENOSPC, <what to do>)``, the
    message the launcher's ``error:`` line shows; any other error passes unchanged."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        if (full := disk_full(error, output_dir)) is not None:
            raise OSError(errno.ENOSPC, full) from error
        raise


# A run with more than this share of its steps skipped as non-finite (train.on_nonfinite=skip)
# fails: its model is barely trained, so it is not exported (skip is for the rare bad batch).
MOST_SKIPPED = 0.5


def skipped_verdict(skipped: int, steps: int) -> tuple[bool, str | None]:
    """(whether the run fails, the line saying how many of its ``steps`` were ``skipped`` as
    non-finite; None when none were)."""
    if not skipped:
        return False, None
    fails = skipped > MOST_SKIPPED * steps
    what = f"{skipped} of {steps} steps {'was' if skipped == 1 else 'were'} skipped as non-finite"
    if fails:
        return True, (
            f"{what} (train.on_nonfinite=skip; more than {MOST_SKIPPED:.0%} fails the run): the "
            "model is barely trained, so hf/ was not exported; metrics.jsonl and any checkpoints "
            "are kept. Lower optim.lr, set train.clip_grad_norm, or use train.on_nonfinite=stop"
        )
    updates = "its update was" if skipped == 1 else "their updates were"
    return False, f"warning: {what} (train.on_nonfinite=skip): {updates} not applied"
