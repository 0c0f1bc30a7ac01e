"""The max_restarts key's check: the recipe's own launcher restarts its ranks from the last complete
checkpoint, so it needs checkpoint.resume=auto; under torchrun its own --max-restarts is the key,
and a note says so."""

import pytest

from components.distributed.layout import resolve_parallel_dims
from recipes.checks import restart_problems, unread_keys
from recipes.compose import compose
from recipes.validate import validate

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def problems_of(overrides: list[str]) -> list[str]:
    return [f"{p.key}: {p.message}" for p in restart_problems(validate(compose(overrides)))]


@pytest.fixture
def local(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def test_restarts_with_resume_auto_pass(local):
    assert problems_of(["max_restarts=2", "checkpoint.resume=auto"]) == []
    assert problems_of([]) == []  # the default: 0


def test_restarts_without_resume_auto_are_refused(local):
    assert problems_of(["max_restarts=1"]) == [
        "max_restarts: max_restarts=1 needs checkpoint.resume=auto (got null): restarted ranks "
        "continue from the last complete checkpoint in output_dir"
    ]


def test_under_torchrun_it_is_noted_not_refused(monkeypatch):
    """A refusal there would end in torchrun's own failure report (and its restarts): a note says
    that torchrun's --max-restarts is the key."""
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    settings = validate(compose(["max_restarts=1"]))
    assert restart_problems(settings) == []
    dims = resolve_parallel_dims(2)
    assert unread_keys(settings, dims) == [
        "max_restarts=1 is the recipe's own launcher's and is not read under torchrun, which "
        "restarts the ranks itself (here --max-restarts=0): pass --max-restarts=1 to torchrun"
    ]
