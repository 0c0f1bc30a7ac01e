"""One way to say no: every check returns problems, :func:`fail` prints them as one ``error:`` line
and exits 2; :func:`say` is the recipe's only other output, from rank 0 alone.

A problem names the key that failed (``tp``, ``train.seq_len``, ``data``, ...), so that what follows
from it (the tp values that fit a model) is decided by the key, never by matching message text.
Each owner returns its problems (``components/problems.py``); the recipe's pre-flight collects them.
This module imports nothing heavy: ``--help`` and the first ``error:`` line stay fast.
"""

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from components.problems import Problem
from components.runtime.console import print_line
from components.runtime.exit_status import INTERRUPTED, INTERRUPTED_STATUS, AlreadyComplete


class ConfigError(ValueError):
    """The one carrier of problems from ``plan_run`` to :func:`fail`."""

    def __init__(self, found: Sequence[Problem]) -> None:
        self.problems = list(found)
        super().__init__("; ".join(problem.message for problem in self.problems))


def is_rank_zero() -> bool:
    """The launching process, or rank 0 (``RANK`` unset or 0)."""
    return os.environ.get("RANK", "0") == "0"


def say(*parts: object, **options) -> None:
    """``print`` on rank 0 only: under torchrun (or the local launcher) one line, not one a rank."""
    if is_rank_zero():
        print(*parts, **options)


def error_line(found: Sequence[Problem] | str) -> str:
    """The ``error:`` line: each problem's first paragraph, on one line, joined by "; "."""
    if isinstance(found, str):
        found = [Problem(key="", message=found)]
    firsts = [problem.message.strip().split("\n\n")[0].replace("\n", " ") for problem in found]
    return f"error: {'; '.join(firsts)}"


def fail(found: Sequence[Problem] | str) -> NoReturn:
    """Print the ``error:`` line on stderr (rank 0 only; the other ranks exit quietly) and exit 2,
    the one exit status for bad input."""
    say(error_line(found), file=sys.stderr)
    sys.exit(2)


@contextmanager
def refusals() -> Iterator[None]:
    """Checking and preparing, before any rank trains: problems end as one ``error:`` line (exit
    2), a run already complete as one ``note:`` line (exit 0), Ctrl-C as one line and status 130,
    no traceback."""
    try:
        yield
    except ConfigError as error:
        fail(error.problems)
    except AlreadyComplete as done:
        say(f"note: {done}")
        raise SystemExit(0) from None
    except KeyboardInterrupt:
        if is_rank_zero():  # under torchrun every rank is interrupted
            print_line(INTERRUPTED, sys.stderr)
        raise SystemExit(INTERRUPTED_STATUS) from None
