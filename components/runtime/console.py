"""Writing to a terminal or log that a progress bar may have left mid-line."""

import os
from typing import Any


def print_line(text: str, stream: Any) -> None:
    """Write ``text`` to ``stream`` so that it starts a line of its own and ends it: after a
    newline when ``stream`` may have been left mid-line (:func:`_may_end_mid_line`), in one write,
    so that nothing another process writes to the same stream (a rank's progress bar) lands
    between that newline, ``text`` and its end."""
    try:
        fresh = "\n" if _may_end_mid_line(stream) else ""
    except (OSError, ValueError, AttributeError):
        fresh = ""
    stream.write(f"{fresh}{text}\n")
    stream.flush()


def _may_end_mid_line(stream: Any) -> bool:
    """Whether the last byte written to ``stream`` may be other than a newline: a regular file's
    is read back; a terminal's, a pipe's or a socket's cannot be (``| tee``, a Slurm step's
    output), so it may, as after a progress bar's partial line."""
    stream.flush()
    descriptor = stream.fileno()
    if not os.path.isfile(f"/proc/self/fd/{descriptor}"):
        return True
    with open(f"/proc/self/fd/{descriptor}", "rb") as readable:
        size = os.fstat(readable.fileno()).st_size
        return bool(size) and os.pread(readable.fileno(), 1, size - 1) != b"\n"
