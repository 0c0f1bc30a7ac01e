"""Ctrl-C before any rank starts (the checks, tokenizing) ends in one line and status 130, no
traceback."""

import pytest

from components.runtime.exit_status import INTERRUPTED_STATUS
from components.runtime.problems import refusals
from components.runtime.ranks import prepare_once


def test_ctrl_c_while_preparing_is_one_line(capsys):
    def interrupted(checked):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as caught, refusals():
        prepare_once(interrupted, checked=None)
    assert caught.value.code == INTERRUPTED_STATUS == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C) before any rank")
