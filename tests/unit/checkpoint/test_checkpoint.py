"""save_checkpoint / find_resumable / load_checkpoint on one process (no process group, plain
tensors), and the checks that run before a resume: damaged and hostile checkpoints, run ids, the
recorded run description.

Sharded saves, resharding and FSDP2 on real ranks are in tests/distributed/test_checkpoint.py.
"""

import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from components.checkpoint import dcp as checkpoint
from components.checkpoint.dcp import (
    MARKER,
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from components.checkpoint.integrity import (
    TRAINER_STATE,
    ResumeChoice,
    check_checkpoint,
    checkpoint_summary,
    complete_checkpoints,
    find_resumable,
    model_fingerprint,
    resume_problems,
    retire_checkpoints_after,
    state_dict_shapes,
)
from components.models import build_causal_lm
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config

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
    restored = load_checkpoint(find_resumable(tmp_path).path, *fresh)
    assert restored == {"step": steps_before_save, "epoch": 1, "offset": 7}
    assert ([step(*fresh) for _ in range(2)], draws()) == continued


def test_a_stateless_optimizer_resumes_over_other_parameters(tmp_path):
    """A pipeline stage's optimizer holds only its stage's parameters, and rank 0 writes the
    optimizer of a stateless SGD: a stage's checkpoint loads into an optimizer over the whole
    model (pp=2 to pp=1), and the whole's into a stage's, at the schedule's lr."""
    model = build_causal_lm(CONFIG, seed=0)
    stage = torch.optim.SGD(list(model.parameters())[:2], lr=0.5)
    stage_scheduler = LambdaLR(stage, lambda step: min(1.0, (step + 1) / 4))
    step(model, stage, stage_scheduler)
    save_checkpoint(tmp_path, 1, model, stage, stage_scheduler)
    whole = trainer(seed=1, optimizer_name="sgd")
    assert load_checkpoint(checkpoint_path(tmp_path, 1), *whole) == {"step": 1}
    assert whole[1].param_groups[0]["lr"] == stage.param_groups[0]["lr"] == 0.25
    assert all(map(torch.equal, whole[0].state_dict().values(), model.state_dict().values()))
    step(*whole)
    save_checkpoint(tmp_path, 2, *whole)
    load_checkpoint(checkpoint_path(tmp_path, 2), model, stage, stage_scheduler)
    assert stage.param_groups[0]["lr"] == 0.375


def test_latest_ignores_tmp_and_unmarked_folders(tmp_path):
    assert (
        find_resumable(tmp_path / "missing").path is None
        and complete_checkpoints(tmp_path / "missing") == []
    )
    assert find_resumable(tmp_path).path is None and complete_checkpoints(tmp_path) == []
    save_checkpoint(tmp_path, 1, *trainer())
    (tmp_path / "step_00000002.tmp").mkdir()
    (
        tmp_path / "step_00000002.tmp" / MARKER
    ).touch()  # a marker inside a .tmp folder does not count
    shutil.copytree(checkpoint_path(tmp_path, 1), tmp_path / "step_00000003")
    (tmp_path / "step_00000003" / MARKER).unlink()
    (tmp_path / "notes").mkdir()
    assert complete_checkpoints(tmp_path) == [checkpoint_path(tmp_path, 1)]
    choice = find_resumable(tmp_path)
    assert choice.path == checkpoint_path(tmp_path, 1)
    assert [path for path, _ in choice.skipped] == [
        tmp_path / "step_00000003"
    ]  # the .tmp one is not even listed
    causes = {
        tmp_path / "step_00000002.tmp": "a .tmp folder is a save that did not finish",
        tmp_path / "step_00000003": "no COMPLETE marker",
        tmp_path / "nothing": "no such folder",
    }
    for path, cause in causes.items():
        with pytest.raises(CheckpointError, match=f"^checkpoint {path} is unusable: {cause}"):
            load_checkpoint(path, *trainer())


def test_a_crash_before_the_commit_leaves_only_an_ignored_tmp_folder(tmp_path):
    state = trainer()
    step(*state)
    save_checkpoint(tmp_path, 1, *state)
    step(*state)
    seen = []

    def crash(folder: Path) -> None:  # what a kill between writing and committing leaves
        seen.append(sorted(path.name for path in folder.iterdir()))
        raise OSError("killed before the marker")

    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, 2, *state, before_commit=crash)
    assert seen == [
        [".metadata", "__0_0.distcp", "rng", TRAINER_STATE]
    ]  # every file, no marker yet
    assert find_resumable(tmp_path) == ResumeChoice(path=checkpoint_path(tmp_path, 1))
    assert save_checkpoint(tmp_path, 2, *state) == checkpoint_path(
        tmp_path, 2
    )  # replaces the stale folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_keep_prunes_only_this_runs_older_checkpoints(tmp_path):
    state = trainer()
    save_checkpoint(tmp_path, 1, *state, run_id="other")  # another run's, older
    save_checkpoint(tmp_path, 9, *state, run_id="other")  # and newer
    for number in range(2, 6):
        save_checkpoint(tmp_path, number, *state, extra={"n": number}, keep=2, run_id="ours")
    names = ["step_00000001", "step_00000004", "step_00000005", "step_00000009"]
    assert sorted(path.name for path in tmp_path.iterdir()) == names
    save_checkpoint(
        tmp_path, 5, *state, extra={"n": 50}, keep=2, run_id="ours"
    )  # a re-save replaces
    assert sorted(path.name for path in tmp_path.iterdir()) == names
    assert load_checkpoint(checkpoint_path(tmp_path, 5), *trainer()) == {"step": 5, "n": 50}
    for bad in ({"keep": 0, "run_id": "ours"}, {"keep": 2}):
        with pytest.raises(ValueError, match="keep"):
            save_checkpoint(tmp_path, 6, *state, **bad)
    with pytest.raises(TypeError, match="Tensor cannot be stored as JSON"):
        save_checkpoint(tmp_path, 6, *state, extra={"position": torch.ones(1)})
    assert not (tmp_path / "step_00000006.tmp").exists()  # refused before anything was written


def test_other_world_size_restores_rank0_rng_everywhere(tmp_path):
    """A checkpoint from 2 ranks (faked from a 1-rank one) loaded by 1: rank 0's states, and a
    warning only when the saved ranks' states differed."""
    torch.manual_seed(0)
    path = save_checkpoint(tmp_path, 0, *trainer())
    expected = draws()
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    (path / TRAINER_STATE).write_text(json.dumps(trainer_state | {"world_size": 2}))
    shutil.copy(path / "rng" / "rank_00000.json", path / "rng" / "rank_00001.json")

    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, *trainer())
    assert not [warning for warning in caught if "rank 0's states" in str(warning.message)]
    assert draws() == expected

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)  # rank 1 drew other numbers than rank 0
        (path / "rng" / "rank_00001.json").write_text(
            checkpoint._rng_to_json(checkpoint._rng_state())
        )
    with pytest.warns(UserWarning, match="rank 0's states"):
        load_checkpoint(path, *trainer())
    assert draws() == expected


# --- checkpoints that would run code
# -------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_metadata_file_that_would_run_code_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoints", 1, *trainer())
    marker = tmp_path / "payload_ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint {path} is unusable: {path}/\.metadata: refused to "
        r"unpickle posix\.system",
    ):
        load_checkpoint(path, *trainer())
    choice = find_resumable(tmp_path / "checkpoints")
    assert choice.path is None and "refused to unpickle posix.system" in choice.skipped[0][1]
    assert not marker.exists()


@pytest.mark.parametrize("name", [TRAINER_STATE, "rng/rank_00000.json"])
def test_a_state_file_holding_a_pickle_is_refused(tmp_path, name):
    path = save_checkpoint(tmp_path, 1, *trainer())
    marker = tmp_path / "payload_ran"
    (path / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint {path} is unusable: {name} is .*not JSON"
    ):
        load_checkpoint(path, *trainer())
    assert not marker.exists()


def test_a_value_blob_that_would_run_code_is_refused(tmp_path):
    """DCP stores non-tensor values (the optimizer's lr, betas) as torch.save blobs; one holding a
    payload."""
    model, optimizer, scheduler = trainer()
    step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    marker = tmp_path / "payload_ran"
    state = checkpoint._state_dict(model, optimizer, model_only=False)
    lr_key = next(key for key in state["optim"] if key.endswith(".lr"))
    state["optim"][lr_key] = Payload(marker)
    for stale in (path / ".metadata", path / "__0_0.distcp"):
        stale.unlink()
    torch.distributed.checkpoint.save(
        state, checkpoint_id=path
    )  # a checkpoint rewritten by someone else
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint {path} is unusable: value optim\..* refused"
    ):
        load_checkpoint(path, *trainer())
    assert not marker.exists()


# --- damaged checkpoints
# --------------------------------------------------------------------------------


def truncate(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


DAMAGE = {
    "truncated_distcp": (
        lambda p: truncate(p / "__0_0.distcp", 0.5),
        r"__0_0\.distcp is truncated \(\d+ bytes",
    ),
    "empty_distcp": (
        lambda p: truncate(p / "__0_0.distcp", 0),
        r"__0_0\.distcp is truncated \(0 bytes",
    ),
    "missing_distcp": (lambda p: (p / "__0_0.distcp").unlink(), r"__0_0\.distcp is missing"),
    "missing_metadata": (lambda p: (p / ".metadata").unlink(), r"\.metadata is missing"),
    "truncated_metadata": (
        lambda p: truncate(p / ".metadata", 0.5),
        r"\.metadata is truncated or not DCP metadata",
    ),
    "missing_trainer_state": (
        lambda p: (p / TRAINER_STATE).unlink(),
        "trainer_state.json is missing",
    ),
    "truncated_trainer_state": (
        lambda p: truncate(p / TRAINER_STATE, 0.5),
        "trainer_state.json is truncated",
    ),
    "missing_rng": (
        lambda p: (p / "rng" / "rank_00000.json").unlink(),
        r"rng/rank_00000\.json is missing",
    ),
    "rng_of_wrong_content": (
        lambda p: (p / "rng" / "rank_00000.json").write_text('{"torch": "AAAA", "numpy": [1]}'),
        r"rng/rank_00000\.json does not hold the RNG states a save writes",
    ),
    "truncated_rng_of_rank_1": (
        lambda p: second_rank_rng(p, keep=0.5),
        r"rng/rank_00001\.json is truncated or not JSON",
    ),
    "distcp_of_random_bytes": (
        lambda p: (p / "__0_0.distcp").write_bytes(os.urandom((p / "__0_0.distcp").stat().st_size)),
        r"__0_0\.distcp is damaged \(no saved tensor at byte 0",
    ),
    "extra_naming_another_step": (
        lambda p: edit_state(p, extra={"step": 99}),
        "names another step than 4",
    ),
}


def edit_state(folder: Path, **values) -> None:
    state = json.loads((folder / TRAINER_STATE).read_text())
    (folder / TRAINER_STATE).write_text(json.dumps({**state, **values}))


def second_rank_rng(folder: Path, keep: float) -> None:
    """The checkpoint as two ranks would have saved it, rank 1's RNG file cut to ``keep``."""
    edit_state(folder, world_size=2)
    rng = folder / "rng"
    (rng / "rank_00001.json").write_bytes((rng / "rank_00000.json").read_bytes())
    truncate(rng / "rank_00001.json", keep)


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    state = trainer()
    for number in (2, 4):
        save_checkpoint(tmp_path, number, *state)
    damaged = checkpoint_path(tmp_path, 4)
    damage_fn, cause = damage
    damage_fn(damaged)
    with pytest.raises(
        CheckpointError, match=f"^checkpoint {damaged} is unusable: .*{cause}"
    ) as info:
        check_checkpoint(damaged)
    assert "\n" not in str(info.value)
    choice = find_resumable(tmp_path)
    assert choice.path == checkpoint_path(tmp_path, 2)
    assert [path for path, _ in choice.skipped] == [damaged]
    assert load_checkpoint(choice.path, *trainer()) == {"step": 2}


def test_the_checked_step_wins_over_extra(tmp_path):
    path = save_checkpoint(tmp_path, 3, *trainer(), extra={"tokens": 7})
    second_rank_rng(path, keep=1.0)  # every rank's file is read: a whole one passes
    assert check_checkpoint(path).world_size == 2
    edit_state(path, world_size=1, extra={"tokens": 7, "step": 3})
    assert load_checkpoint(path, *trainer()) == {"tokens": 7, "step": 3}


def test_no_usable_checkpoint_and_an_empty_root(tmp_path):
    assert find_resumable(tmp_path / "missing").path is None
    save_checkpoint(tmp_path, 3, *trainer())
    (checkpoint_path(tmp_path, 3) / MARKER).unlink()
    (tmp_path / "step_00000005.tmp").mkdir()  # a save in progress: not a candidate, not reported
    choice = find_resumable(tmp_path)
    assert choice.path is None
    assert choice.skipped == [
        (checkpoint_path(tmp_path, 3), "no COMPLETE marker (a save that did not finish)")
    ]


# --- what a checkpoint records about its run
# ----------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_summary_holds_the_run_description_and_the_model_shapes(tmp_path, tied):
    config = tiny_config("llama", num_hidden_layers=1, tie_word_embeddings=tied)
    model = build_causal_lm(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shapes = state_dict_shapes(model)
    run_info = {
        "model": model_fingerprint(shapes),
        "optimizer": "AdamW",
        "global_batch_size": 16,
        "seq_len": 48,
    }
    path = save_checkpoint(
        tmp_path, 7, model, optimizer, None, run_id="run-a", run_info=run_info | {"tp": 2}
    )
    summary = checkpoint_summary(path)
    assert (summary.path, summary.step, summary.world_size, summary.run_id) == (path, 7, 1, "run-a")
    assert summary.run_info == run_info | {"tp": 2}
    assert summary.parameter_shapes == shapes
    assert model_fingerprint(summary.parameter_shapes) == run_info["model"]

    assert resume_problems(summary, run_info, max_steps=8) == []
    other = run_info | {"optimizer": "SGD", "global_batch_size": 32}
    assert resume_problems(summary, other, max_steps=7) == [
        "optimizer is 'SGD' but the checkpoint was written with 'AdamW'",
        "global_batch_size is 32 but the checkpoint was written with 16",
        "max_steps 7 is not beyond the checkpoint's step 7: nothing to train",
    ]


def test_a_second_branch_keeps_the_first_branchs_abandoned_checkpoints(tmp_path):
    """Resumed from step 10 twice (each run then saved steps 15 and 20 again): every abandoned
    checkpoint is kept, the first branch's under its name, the second's numbered after it."""

    def branch(marker: str) -> None:
        for step in (10, 15, 20):
            folder = tmp_path / f"step_{step:08d}"
            folder.mkdir(exist_ok=True)
            (folder / "which").write_text(marker)

    branch("first")
    first = retire_checkpoints_after(tmp_path, 10)
    branch("second")
    second = retire_checkpoints_after(tmp_path, 10)
    assert [path.name for path in first] == ["step_00000015.abandoned", "step_00000020.abandoned"]
    assert [path.name for path in second] == [
        "step_00000015.abandoned_2",
        "step_00000020.abandoned_2",
    ]
    assert (tmp_path / "step_00000020.abandoned" / "which").read_text() == "first"
    assert (tmp_path / "step_00000020.abandoned_2" / "which").read_text() == "second"
    assert (tmp_path / "step_00000010" / "which").read_text() == "second"
