"""Ctrl-C before any rank starts (the checks, tokenizing) ends in one line and status 130, no
traceback."""

import pytest

import recipes.checks
from recipes.finetune import INTERRUPTED_STATUS, launch


def test_ctrl_c_while_planning_is_one_line(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipes.checks, "plan_run", interrupted)
    with pytest.raises(SystemExit) as caught:
        launch(None, None, None)
    assert caught.value.code == INTERRUPTED_STATUS == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C) before any rank")
