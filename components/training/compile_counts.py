"""Graph breaks and recompilations of ``train.compile``, counted with Dynamo's own counters
(``torch._dynamo.utils.counters``) in the rank that compiles, around its training steps.

A graph break splits a compiled block into graphs with eager Python between them (on a GPU each
break costs launches and kills CUDA graphs, async TP and float8's fusion); a recompilation after
the first step means a guard failed and the block was compiled again. The first step compiles
every block: its breaks are counted; every frame Dynamo compiles in a later step is a
recompilation. Each kind is said once, as a ``note:`` line, when it is first seen.

Docs: docs/precision-and-memory.md
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch._dynamo.utils import counters

# Counter groups of graph breaks: a break Dynamo resumed after (``graph_break``), and one that
# made it run the whole frame eagerly (``unimplemented``).
_BREAK_GROUPS = ("graph_break", "unimplemented")
_REASONS_SHOWN = 3


def graph_breaks() -> dict[str, int]:
    """Every graph break Dynamo counted in this process so far: its reason's first line ->
    count."""
    found: dict[str, int] = {}
    for group in _BREAK_GROUPS:
        for reason, count in counters[group].items():
            first = str(reason).strip().splitlines()[0] if str(reason).strip() else "?"
            found[first] = found.get(first, 0) + count
    return {reason: count for reason, count in found.items() if count > 0}


def frames_compiled() -> int:
    """Frames Dynamo compiled in this process so far (first compilations and recompilations)."""
    return counters["frames"]["total"]


@dataclass(kw_only=True)
class CompileCounts:
    """What one rank's compiled blocks did in its training steps: graph breaks in the first step
    and frames compiled in the later ones (recompilations). Create it before the first step and
    wrap each step in :meth:`step`, which hands each note, once, to ``say``."""

    breaks_before: dict[str, int]  # counted before the first step (another compiled function's)
    say: Callable[[str], None] | None = None  # where the notes go after each step (None: kept)
    first_step_done: bool = False
    breaks: int = 0  # in the first step
    reasons: tuple[str, ...] = ()
    recompiled: int = 0  # frames compiled in the steps after the first
    recompiled_at: int | None = None  # the first such step (1-based)
    said: frozenset[str] = frozenset()

    @classmethod
    def start(cls, say: Callable[[str], None] | None = None) -> "CompileCounts":
        return cls(breaks_before=graph_breaks(), say=say)

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Count around the training step ``number`` (1-based)."""
        frames = frames_compiled()
        yield
        if not self.first_step_done:
            self._count_breaks()
        elif compiled := frames_compiled() - frames:
            self.recompiled += compiled
            self.recompiled_at = self.recompiled_at or number
        for line in self.notes() if self.say else ():
            self.say(line)

    def _count_breaks(self) -> None:
        before, now = self.breaks_before, graph_breaks()
        new = {reason: count - before.get(reason, 0) for reason, count in now.items()}
        new = {reason: count for reason, count in new.items() if count > 0}
        self.breaks, self.reasons = sum(new.values()), tuple(new)
        self.first_step_done = True

    def notes(self) -> list[str]:
        """The ``note:`` lines not said yet (each kind once): breaks, recompilations."""
        found = {}
        if self.breaks:
            shown = "; ".join(self.reasons[:_REASONS_SHOWN])
            found["breaks"] = (
                f"note: train.compile: Dynamo counted {self.breaks} graph break(s) in the first "
                f"step, each a stretch of eager Python between compiled graphs ({shown}): "
                "TORCH_LOGS=graph_breaks shows where"
            )
        if self.recompiled:
            found["recompiled"] = (
                f"note: train.compile: Dynamo compiled {self.recompiled} frame(s) again from "
                f"step {self.recompiled_at} on (a guard failed after the first step): "
                "TORCH_LOGS=recompiles shows why"
            )
        new = [line for kind, line in found.items() if kind not in self.said]
        self.said |= frozenset(found)
        return new
