"""A run's checkpoints as its runtime uses them: resuming from one, stopping after a step with one
(a SIGTERM or SIGUSR1 on any rank stops every rank: one all-reduce per step, in the checkpoint
writer), and the run's last line naming what it left."""

from pathlib import Path

from components.checkpoint.dcp import load_checkpoint
from components.checkpoint.integrity import complete_checkpoints
from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter
from components.runtime import preemption
from components.runtime.exit_status import STOPPED_STATUS
from components.runtime.launch import under_torchrun
from components.runtime.problems import say


def resume(checkpoint: Path | None, state: TrainState) -> None:
    """``state`` as ``checkpoint`` saved it (model, optimizer, schedule, step: every part of it),
    and said; without a ``checkpoint`` it stays as built, at step 0."""
    if checkpoint is None:
        return
    loaded = load_checkpoint(checkpoint, state.model, state.optimizer, state.schedule)
    state.step = loaded["step"]
    if state.stream is not None:  # a streamed loader's position (data.streaming)
        state.stream.load_state_dict(loaded["data"])
    say(f"resumed from {checkpoint} at step {state.step}")


def stop_signal(writer: CheckpointWriter, state: TrainState) -> str | None:
    """The name of the signal that stops the run after ``state.step`` (with a checkpoint of
    ``state``), or None: what the ranks agreed at the step's end (``writer.stop_asked``, read with
    the step's other values)."""
    if not writer.stop_asked:
        return None
    own = preemption.stop_requested()
    stopped = own.name if own is not None else "a signal to another rank"
    if writer.last_step != state.step:  # a checkpoint of this step, even with every_steps=0
        writer.save(state)
    return stopped


def done_line(
    output_dir: Path,
    max_steps: int,
    ended: bool,
    exported: bool,
    folders: tuple[str, ...] = ("hf/",),
) -> str:
    """The run's last line, naming only what it left: the export's ``folders`` only when exported
    now, and before the end (``train.stop_after``, a stop signal) the checkpoint
    ``checkpoint.resume=auto`` continues from."""
    wrote = ["metrics", "loss.png", *(folders if exported else [])]
    if ended or not (checkpoints := complete_checkpoints(output_dir / "checkpoints")):
        return f"done: {', '.join(wrote[:-1])} and {wrote[-1]} in {output_dir}"
    latest = checkpoints[-1]
    return (
        f"done: metrics, loss.png and checkpoint {latest.name} in {output_dir} (no hf/ before "
        f"step {max_steps}); checkpoint.resume=auto continues from it"
    )


def stop_note(stopped: str, done: int, max_steps: int, checkpoint: Path | None) -> str:
    """The ``note:`` line of a run ``stopped`` by a signal after step ``done``, with the status it
    ends with: :data:`STOPPED_STATUS`, or 0 under torchrun, which would restart ranks that end
    otherwise (``components.runtime.ranks.run_ranks``)."""
    torchrun = under_torchrun()
    status = "0 under torchrun, which would restart ranks that end otherwise" if torchrun else ""
    return (
        f"note: stopped by {stopped} after step {done} of {max_steps}: checkpoint {checkpoint}; "
        f"checkpoint.resume=auto continues (exit status {status or STOPPED_STATUS})"
    )
