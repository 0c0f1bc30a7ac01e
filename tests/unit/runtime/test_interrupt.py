"""Ctrl-C before any rank starts (the checks, tokenizing) ends in one line and status 130, no
traceback."""

import pytest

from components.runtime.exit_status import INTERRUPTED_STATUS
from components.runtime.problems import refusals
from components.runtime.ranks import failure_told_to_waiting_ranks


def test_ctrl_c_while_preparing_is_one_line(capsys):
    with pytest.raises(SystemExit) as caught, refusals(), failure_told_to_waiting_ranks():
        raise KeyboardInterrupt  # while the recipe's preparation runs
    assert caught.value.code == INTERRUPTED_STATUS == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C) before any rank")
