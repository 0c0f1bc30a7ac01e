"""Writing to a terminal or log that a progress bar may have left mid-line."""

import os
from typing import Any


def start_fresh_line(stream: Any) -> None:
    """Make the next write to ``stream`` start a line: when it is a regular file, write a newline
    only if its last byte is not one; otherwise (a terminal or pipe, where a progress bar may have
    left the cursor mid-line) write a newline when ``stream`` is a tty. Errors reading back are
    ignored."""
    try:
        stream.flush()
        descriptor = stream.fileno()
        if os.path.isfile(f"/proc/self/fd/{descriptor}"):
            with open(f"/proc/self/fd/{descriptor}", "rb") as readable:
                size = os.fstat(readable.fileno()).st_size
                if size and os.pread(readable.fileno(), 1, size - 1) != b"\n":
                    stream.write("\n")
        elif stream.isatty():
            stream.write("\n")
    except (OSError, ValueError, AttributeError):
        return
