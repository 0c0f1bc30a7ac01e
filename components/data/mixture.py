"""Mixtures of sources: which source each position of the training stream takes its row from.

Source ``s`` of weight ``w_s`` gets its ``j``-th row at the virtual time ``(2j + 1) / w_s`` (stride
scheduling); the stream is every source's rows merged by that time, ties to the lower source index.
Over any window of ``n`` positions source ``s`` then holds ``n × w_s / Σw`` rows within about one,
not only at the end. The weights are exact fractions (``Fraction(weight).limit_denominator``), so
position ``p``'s source is a function of ``p`` alone: :func:`interleave` finds it by a binary search
without walking the stream from its start, and a resume at any step and any dp reads the same rows.

A source whose rows run out is recycled: its ``k``-th row is row ``k mod n`` of its ``k // n``-th
epoch's permutation, as a single source's are (:mod:`components.data.loader`).

Docs: docs/data.md
"""

import heapq
import math
from fractions import Fraction

MAX_DENOMINATOR = 10**6  # weights are read to six digits: 0.6 is 3/5, 1/3 is 1/3


def integer_weights(weights: list[float]) -> list[int]:
    """The weights as integers in the same proportions (zero stays zero).

    Raises:
        ValueError: If a weight is negative or not finite, or every weight is zero.
    """
    if any(not math.isfinite(weight) or weight < 0 for weight in weights) or not any(weights):
        raise ValueError(f"mixture weights must be >= 0, finite and not all zero, got {weights}")
    fractions = [Fraction(weight).limit_denominator(MAX_DENOMINATOR) for weight in weights]
    scale = math.lcm(*(fraction.denominator for fraction in fractions))
    return [int(fraction * scale) for fraction in fractions]


def _taken_before(time: Fraction, weights: list[int]) -> list[int]:
    """Rows of each source whose virtual time ``(2j + 1) / w`` is below ``time``."""
    return [math.ceil((time * weight - 1) / 2) if weight else 0 for weight in weights]


def _taken_by(time: Fraction, weights: list[int]) -> int:
    """Rows of all sources whose virtual time is at most ``time``."""
    return sum(math.floor((time * weight + 1) / 2) if weight else 0 for weight in weights)


def _time_of(position: int, weights: list[int]) -> Fraction:
    """The virtual time of the row at ``position`` of the merged stream: the least time of a row
    such that more than ``position`` rows have a time at most it."""
    best = None
    for weight in weights:
        if not weight:
            continue
        low, high = 0, position  # the source's row j: its time (2j + 1) / weight
        while low < high:
            middle = (low + high) // 2
            if _taken_by(Fraction(2 * middle + 1, weight), weights) > position:
                high = middle
            else:
                low = middle + 1
        time = Fraction(2 * low + 1, weight)
        if _taken_by(time, weights) > position and (best is None or time < best):
            best = time
    return best


def interleave(weights: list[int], start: int, count: int) -> list[tuple[int, int]]:
    """(source, k) of positions ``start .. start + count - 1`` of the merged stream: position ``p``
    takes source ``s``'s ``k``-th row (``k`` counts on past the source's size: recycling is the
    reader's)."""
    time = _time_of(start, weights)
    taken = _taken_before(time, weights)
    tied = [s for s, w in enumerate(weights) if w and (time * w - 1) % 2 == 0]  # a row at `time`
    for source in tied[: start - sum(taken)]:  # those tied rows already before `start`
        taken[source] += 1
    pairs = enumerate(zip(taken, weights, strict=True))
    queue = [(Fraction(2 * k + 1, w), s) for s, (k, w) in pairs if w]
    heapq.heapify(queue)
    chosen = []
    for _ in range(count):
        _, source = heapq.heappop(queue)
        chosen.append((source, taken[source]))
        taken[source] += 1
        heapq.heappush(queue, (Fraction(2 * taken[source] + 1, weights[source]), source))
    return chosen
