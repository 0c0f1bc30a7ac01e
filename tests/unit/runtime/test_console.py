"""A line the run says (``error:``, ``note:``) starts a line of its own on any stream a progress bar
may have left mid-line: a pipe (``| tee``, a Slurm step) as well as a file or a terminal, in one
write, so another process's output cannot land inside it."""

import os

from components.runtime.console import print_line

BAR = "\r 40%|####      | 4/10 [00:02<00:03,  2.07step/s, loss=5.4259]"


class Recorded:
    """A text stream over a descriptor that records each write it is given."""

    def __init__(self, descriptor: int):
        self.descriptor, self.writes = descriptor, []

    def write(self, text: str) -> None:
        self.writes.append(text)
        os.write(self.descriptor, text.encode())

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.descriptor


def test_after_a_bar_on_a_pipe_the_line_starts_a_line_in_one_write():
    read, write = os.pipe()
    os.write(write, BAR.encode())  # another process's partial line: a pipe cannot be read back
    stream = Recorded(write)
    print_line("error: rank 1 made no progress", stream)
    os.close(write)
    with open(read, "rb") as pipe:
        assert pipe.read() == f"{BAR}\nerror: rank 1 made no progress\n".encode()
    assert stream.writes == ["\nerror: rank 1 made no progress\n"]


def test_a_file_gets_a_newline_only_after_a_partial_line(tmp_path):
    path = tmp_path / "run.err"
    for before, expected in [(BAR, f"{BAR}\nnote: x\n"), ("done\n", "done\nnote: x\n")]:
        path.write_text(before)
        with open(path, "a") as stream:
            print_line("note: x", stream)
        assert path.read_bytes().decode() == expected
    path.write_text("")
    with open(path, "a") as stream:
        print_line("note: x", stream)
    assert path.read_text() == "note: x\n"
