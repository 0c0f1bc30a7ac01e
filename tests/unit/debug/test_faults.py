"""The kill faults (``debug.fault=kill...``) behind the restart tests: parsed like the others, they
strike only the last rank, only at their step, and never in an attempt torch elastic restarted
(``TORCHELASTIC_RESTART_COUNT`` above 0), so a restarted run goes past them."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from components.debug.faults import Fault, install_faults, parse_fault

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kind", ["kill", "kill_in_collective", "kill_in_save"])
def test_the_kill_faults_parse_with_a_step(kind):
    assert parse_fault(f"{kind}@3") == Fault(kind=kind, step=3)
    for text in (kind, f"{kind}@0", f"{kind}@x"):
        with pytest.raises(ValueError, match="kill_in_collective@STEP"):
            parse_fault(text)


def install(text: str, rank: int, model: nn.Module) -> None:
    where = dict(rank=rank, world_size=2, first_step=0, micro_batches_per_step=1)
    install_faults(parse_fault(text), model, torch.optim.SGD(model.parameters()), **where)


@pytest.mark.parametrize("restart_count", [None, "0", "1"])
def test_a_kill_spares_other_ranks_other_steps_and_restarted_attempts(monkeypatch, restart_count):
    if restart_count is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    first_rank, last_rank = nn.Linear(2, 2), nn.Linear(2, 2)
    install("kill@1", 0, first_rank)
    install("kill_in_save@1", 0, first_rank)
    install("kill@2", 1, last_rank)  # the last rank, but step 2 of a first attempt
    first_rank(torch.ones(2))
    first_rank.state_dict()
    last_rank(torch.ones(2))  # step 1
    if restart_count == "1":  # restarted: step 2 and its save pass
        install("kill_in_save@2", 1, last_rank)
        last_rank(torch.ones(2))
        last_rank.state_dict()


# The last rank's save of step 1: its forward passes, the state dict of its save kills it.
KILLED_IN_SAVE = textwrap.dedent(
    """
    import torch
    from components.debug.faults import install_faults, parse_fault

    model = torch.nn.Linear(2, 2)
    where = dict(rank=1, world_size=2, first_step=0, micro_batches_per_step=1)
    optimizer = torch.optim.SGD(model.parameters())
    install_faults(parse_fault("kill_in_save@1"), model, optimizer, **where)
    model.state_dict()  # before any training step: not a save of step 1
    model(torch.ones(2))
    print("step 1 done", flush=True)
    model.state_dict()
    print("still alive", flush=True)
    """
)


def test_kill_in_save_sigkills_the_last_rank_in_the_save_of_its_step():
    environment = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    result = subprocess.run(
        [sys.executable, "-c", KILLED_IN_SAVE],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert result.stdout.splitlines() == ["step 1 done"]
    assert "injected fault (debug.fault=kill_in_save@1): SIGKILL in the save of step 1" in (
        result.stderr
    )
