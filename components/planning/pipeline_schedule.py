"""Pipeline arithmetic of the dry run, for ``torch.distributed.pipelining``'s schedules as the
recipe runs them: the micro-batches' activations a pipeline rank holds at its peak, whether its
gradients already exist then, and the bubble. ``m``: the step's micro-batches, ``v``: stages per
rank. The counts follow torch's own schedules:

- ``gpipe``: every forward before any backward, so each rank holds all ``m``.
- ``1f1b`` (``Schedule1F1B``): rank ``s`` (0-based) runs ``min(m, pp - s)`` forwards, then one
  backward before each further forward: it holds ``min(pp - s, m)``.
- ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``): rank ``s`` runs
  ``W = min((v - 1)·r + 2·(pp - 1 - s), m·v)`` forward chunks first (a chunk: one micro-batch
  through one of its ``v`` stages; ``r = m // max(1, m // pp)`` micro-batches per round), then a
  forward before each backward: ``min(W + 1, m·v)`` chunks, each ``1/v`` of a micro-batch through
  all the rank's layers (its stages taken as equal).
"""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _chunks(schedule: str, pp: int, rank: int, micro_batches: int, stages_per_rank: int) -> int:
    """Forward chunks (one micro-batch through one stage) rank ``rank`` holds at its peak."""
    m, v = micro_batches, stages_per_rank
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(pp - rank, m)
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        return min(warmup + 1, m * v)
    raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULES)}")


def in_flight(
    schedule: str, pp: int, rank: int, micro_batches: int, stages_per_rank: int = 1
) -> float:
    """Micro-batches' activations (each through all of the rank's layers) that pipeline rank
    ``rank`` holds at once, at its peak."""
    chunks = _chunks(schedule, pp, rank, micro_batches, stages_per_rank)
    return chunks / stages_per_rank


def grads_held(
    schedule: str, pp: int, rank: int, micro_batches: int, stages_per_rank: int = 1
) -> bool:
    """Whether the rank's gradients exist at that peak: a backward ran before it (1F1B's steady
    state, when there are more chunks than the rank holds at once); GPipe's come after it."""
    chunks = _chunks(schedule, pp, rank, micro_batches, stages_per_rank)
    return schedule != "gpipe" and chunks < micro_batches * stages_per_rank


def bubble(schedule: str, pp: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a step: ``(pp - 1) / (m + pp - 1)`` for GPipe and 1F1B,
    ``(pp - 1) / (v·m + pp - 1)`` interleaved (each rank's ``v`` stages fill the pipeline ``v``
    times faster)."""
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)
