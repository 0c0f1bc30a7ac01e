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


class AlreadyComplete(Exception):
    """The run asked for is already done (``checkpoint.resume=auto`` on a finished run): nothing to
    train, which is no failure. Its message is said as one ``note:`` line and the command exits 0
    (``components.runtime.problems.refusals``)."""


# Free space below which a failed write is taken for a full disk (torch's checkpoint writer
# reports one as "unexpected pos 704 vs 598", without the errno).
FULL_BYTES = 64 * 2**20


def disk_full(error: BaseException, output_dir: Path, max_steps: int | None = None) -> str | None:
    """What a write that failed on a full disk under ``output_dir`` says (the folder, the space
    left, the checkpoint that survives and how to go on from it), or None when ``error`` is not
    that. ``max_steps``: the run's, whose last step's checkpoint ``checkpoint.resume=auto`` would
    refuse (nothing to train)."""

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
    return (
        f"no space left on device in {output_dir} ({free / 2**20:.1f} MiB free): "
        f"{_way_on(output_dir, max_steps)}, or choose an output_dir on another disk"
    )


def _way_on(output_dir: Path, max_steps: int | None) -> str:
    """What survives a full disk in ``output_dir`` and the command that goes on from it: resume
    from a checkpoint before the last step; after the last one (the export failed) resume with more
    steps, or train again; with none, train again (the folder now holds this run's files)."""
    from components.checkpoint.integrity import STEP_FOLDER, complete_checkpoints

    again = "overwrite_output_dir=true trains again"
    if not (kept := complete_checkpoints(output_dir / "checkpoints")):
        return f"no checkpoint was written yet: free space, then {again}"
    step = int(STEP_FOLDER.match(kept[-1].name).group(1))
    if max_steps is None or step < max_steps:
        return (
            f"the last complete checkpoint, {kept[-1].name}, is kept: free space and "
            "checkpoint.resume=auto continues from it"
        )
    return (
        f"the last complete checkpoint, {kept[-1].name}, is of the run's last step but hf/ was "
        "not written: free space, then checkpoint.resume=auto with a train.max_steps above "
        f"{step} trains on from it and exports, or {again}"
    )


@contextmanager
def disk_full_said_plainly(output_dir: Path, max_steps: int | None = None) -> Iterator[None]:
    """Re-raise a write that failed on a full disk as ``OSError(ENOSPC, <what to do>)``, the
    message the launcher's ``error:`` line shows; any other error passes unchanged. ``max_steps``:
    the run's (see :func:`disk_full`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        if (full := disk_full(error, output_dir, max_steps)) is not None:
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
