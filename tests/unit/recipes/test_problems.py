"""One way to say no: problems, one printer and exit status, rank 0's output alone, and the tp
values that fit named after a tp the model refuses."""

from types import SimpleNamespace

import pytest

from components.models.checks import tp_problems
from components.problems import Problem, problems
from components.runtime.problems import ConfigError, error_line, fail, say


def test_fail_prints_one_error_line_of_every_problem_and_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    found = [
        Problem(key="tp", message="tp (3) must divide num_attention_heads (8)"),
        Problem(key="overrides", message="Could not find 'model/gpt5'\n\nAvailable options:\n  a"),
        Problem(key="data", message="data: a message\nwrapped over two lines"),
    ]
    with pytest.raises(SystemExit) as stop:
        fail(found)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: tp (3) must divide num_attention_heads (8); Could not find 'model/gpt5'; "
        "data: a message wrapped over two lines\n"
    )


def test_a_config_error_carries_its_problems_and_reads_as_them_joined():
    found = problems("optim", ["lr=-1 is not valid", "betas out of range"])
    error = ConfigError(found)
    assert error.problems == found
    assert str(error) == "lr=-1 is not valid; betas out of range"
    assert error_line(str(error)) == error_line(found) == f"error: {error}"


@pytest.mark.parametrize("rank", ["1", "3"])
def test_only_rank_0_prints(monkeypatch, capsys, rank):
    monkeypatch.setenv("RANK", rank)
    say("note: something")
    with pytest.raises(SystemExit) as stop:
        fail([Problem(key="tp", message="no")])
    assert stop.value.code == 2  # every rank exits with the status, quietly
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    say("note: something")
    assert capsys.readouterr().out == "note: something\n"


CONFIG = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64)


def test_a_tp_the_model_refuses_is_followed_by_the_tp_values_that_fit():
    assert tp_problems(CONFIG, 8) == [
        Problem(key="tp", message="tp (8) must divide num_key_value_heads (4)"),
        Problem(key="tp", message="tp values that fit this model: 1, 2, 4"),
    ]
    assert tp_problems(CONFIG, 2) == tp_problems(CONFIG, 1) == []
