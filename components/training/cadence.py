"""When a training loop validates, saves, checks the TP replicas and stops: one small object the
loop asks after each step, with the steps done."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """The run's step cadence. ``max_steps``: the run's length (the schedule's, and the step of the
    export); ``last_step``: where this launch stops (``max_steps``, or earlier with
    ``train.stop_after``). Each ``*_every`` is in steps, 0 for never: ``validate_every`` (and after
    the last step too), ``save_every`` (a checkpoint, and after the last step too),
    ``check_replicas_every`` (the TP replicas compared)."""

    max_steps: int
    last_step: int
    validate_every: int
    save_every: int
    check_replicas_every: int

    def steps(self, done: int) -> range:
        """The 0-based steps this launch runs after the ``done`` ones (a resume's)."""
        return range(done, self.last_step)

    def validate(self, done: int) -> bool:
        """Whether to validate after step ``done``: every ``validate_every`` steps, and the last."""
        every = self.validate_every
        return bool(every) and (done % every == 0 or done == self.max_steps)

    def save(self, done: int) -> bool:
        """Whether to save a checkpoint after step ``done``: every ``save_every`` steps, and the
        last (so that ``checkpoint.resume=auto`` finds the run complete, never trains its last
        steps again)."""
        every = self.save_every
        return bool(every) and (done % every == 0 or done == self.max_steps)

    def check_replicas(self, done: int) -> bool:
        """Whether to compare the TP replicas after step ``done``."""
        every = self.check_replicas_every
        return bool(every) and done % every == 0

    def save_at_stop(self, first: int, done: int) -> bool:
        """Whether a launch that ran from step ``first`` and stopped after ``done`` saves that
        step: before the run's end (``train.stop_after``), so that a resume continues there; at
        the end of a resumed launch, so that ``checkpoint.resume=auto`` then finds the run
        complete (its newest checkpoint at ``max_steps``), never its stop's step to train on."""
        return first < done and (done < self.max_steps or first > 0)
