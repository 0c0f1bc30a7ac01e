"""save_checkpoint / latest_checkpoint / load_checkpoint on one process (no process group, plain tensors).

Sharded saves, resharding and FSDP2 on real ranks are in tests/distributed/test_checkpoint.py.
"""

import random
import shutil
import warnings

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from components.models import build_causal_lm, tiny_config
from components.training import checkpoint
from components.training.checkpoint import (
    MARKER,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from components.training.step import forward_backward

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CONFIG = tiny_config("llama", num_hidden_layers=1)


def trainer(seed: int = 0, optimizer_name: str = "adamw") -> tuple:
    model = build_causal_lm(CONFIG, seed=seed)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:  # no per-parameter state at all: only the lr (moved by the scheduler) needs restoring
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, optimizer, LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def step(model, optimizer, scheduler) -> float:
    """One step on a batch drawn from the global torch RNG (so a resume must restore it)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    optimizer.zero_grad()
    loss = forward_backward(model, tokens, tokens, 14)
    optimizer.step()
    scheduler.step()
    return loss


def draws() -> tuple:
    return torch.rand(2).tolist(), random.random(), np.random.rand()


@pytest.mark.parametrize(
    "steps_before_save, optimizer_name",
    [(2, "adamw"), (0, "adamw"), (2, "sgd")],
    ids=["after_2_steps", "never_stepped", "stateless_sgd"],
)
def test_resume_is_exact(tmp_path, steps_before_save, optimizer_name):
    torch.manual_seed(0)
    state = trainer(optimizer_name=optimizer_name)
    for _ in range(steps_before_save):
        step(*state)
    rng = torch.get_rng_state()
    save_checkpoint(tmp_path, steps_before_save, *state, extra={"epoch": 1, "offset": 7})
    assert torch.equal(torch.get_rng_state(), rng), "saving must not consume or change the RNG"
    assert bool(state[1].state) == (steps_before_save > 0 and optimizer_name == "adamw")
    continued = [step(*state) for _ in range(2)], draws()

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    fresh = trainer(seed=1, optimizer_name=optimizer_name)
    restored = load_checkpoint(latest_checkpoint(tmp_path), *fresh)
    assert restored == {"step": steps_before_save, "epoch": 1, "offset": 7}
    assert ([step(*fresh) for _ in range(2)], draws()) == continued


def test_latest_ignores_tmp_and_unmarked_folders(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, *trainer())
    (tmp_path / "step_00000002.tmp").mkdir()
    (tmp_path / "step_00000002.tmp" / MARKER).touch()  # a marker inside a .tmp folder does not count
    shutil.copytree(checkpoint_path(tmp_path, 1), tmp_path / "step_00000003")
    (tmp_path / "step_00000003" / MARKER).unlink()
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    for path in (tmp_path / "step_00000002.tmp", tmp_path / "step_00000003", tmp_path / "nothing"):
        with pytest.raises(FileNotFoundError, match=str(path)):
            load_checkpoint(path, *trainer())


def test_a_crash_mid_save_leaves_only_an_ignored_tmp_folder(tmp_path, monkeypatch):
    state = trainer()
    step(*state)
    save_checkpoint(tmp_path, 1, *state)
    step(*state)

    def crash(*args):
        raise OSError("killed before the marker")

    monkeypatch.setattr(checkpoint, "_write_marker", crash)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, 2, *state)
    assert (tmp_path / "step_00000002.tmp" / ".metadata").is_file()  # the shards were written
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)

    monkeypatch.undo()
    assert save_checkpoint(tmp_path, 2, *state) == checkpoint_path(tmp_path, 2)  # replaces the stale folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_keep_prunes_older_checkpoints_and_a_resave_replaces(tmp_path):
    state = trainer()
    for number in range(1, 5):
        save_checkpoint(tmp_path, number, *state, extra={"n": number}, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    save_checkpoint(tmp_path, 4, *state, extra={"n": 40}, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert load_checkpoint(checkpoint_path(tmp_path, 4), *trainer()) == {"step": 4, "n": 40}
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 5, *state, keep=0)
    assert not (tmp_path / "step_00000005.tmp").exists()


def test_other_world_size_restores_rank0_rng_everywhere(tmp_path):
    """A checkpoint from 2 ranks (faked from a 1-rank one) loaded by 1: rank 0's states, and a warning
    only when the saved ranks' states differed."""
    torch.manual_seed(0)
    path = save_checkpoint(tmp_path, 0, *trainer())
    expected = draws()
    trainer_state = torch.load(path / checkpoint.TRAINER_STATE, weights_only=False)
    torch.save(trainer_state | {"world_size": 2}, path / checkpoint.TRAINER_STATE)
    shutil.copy(path / "rng" / "rank_00000.pt", path / "rng" / "rank_00001.pt")

    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, *trainer())
    assert not [warning for warning in caught if "rank 0's states" in str(warning.message)]
    assert draws() == expected

    other = torch.load(path / "rng" / "rank_00000.pt", weights_only=False) | {"torch": torch.get_rng_state()}
    torch.save(other, path / "rng" / "rank_00001.pt")
    with pytest.warns(UserWarning, match="rank 0's states"):
        load_checkpoint(path, *trainer())
    assert draws() == expected
