"""A resume that cannot continue the checkpoint's run names what differs: the first differing tensor
(not the model's hash), the seed, the split, the data."""

from pathlib import Path

from components.checkpoint.integrity import (
    CheckpointSummary,
    model_fingerprint,
    resume_problems,
)

SHAPES = {"lm_head.weight": (256, 64), "model.embed_tokens.weight": (256, 64)}
DATA = {"source": "data.path=/d/a.jsonl", "fingerprint": "f1"}
INFO = {
    "model": model_fingerprint(SHAPES),
    "tokenizer": "t1",
    "seed": 0,
    "data.val_fraction": 0.1,
    "data.loss_on": "all_assistant",
    "data": DATA,
}


def summary(run_info=INFO) -> CheckpointSummary:
    return CheckpointSummary(
        path=Path("/c/step_00000004"),
        step=4,
        world_size=1,
        run_id="r",
        run_info=dict(run_info),
        parameter_shapes=SHAPES,
    )


def test_a_model_of_another_shape_is_named_by_its_first_differing_tensor():
    shapes = {**SHAPES, "lm_head.weight": (300, 64)}
    expected = {**INFO, "model": model_fingerprint(shapes)}
    assert resume_problems(summary(), expected, 8, shapes) == [
        "the model is not the checkpoint's: lm_head.weight is [300, 64] here but [256, 64] in the "
        "checkpoint"
    ]
    extra = {**SHAPES, "model.norm.weight": (64,)}
    assert resume_problems(summary(), {**INFO, "model": "x"}, 8, extra) == [
        "the model is not the checkpoint's: model.norm.weight is not in the checkpoint"
    ]


def test_another_seed_split_or_data_is_refused_naming_it():
    other = {
        **INFO,
        "seed": 1,
        "data.val_fraction": 0.2,
        "data.loss_on": "last_assistant",
        "data": {**DATA, "fingerprint": "f2"},
    }
    assert resume_problems(summary(), other, 8) == [
        "seed is 1 but the checkpoint was written with 0",
        "data.val_fraction is 0.2 but the checkpoint was written with 0.1",
        "data.loss_on is 'last_assistant' but the checkpoint was written with 'all_assistant'",
        "the data (data.path=/d/a.jsonl) has changed since the checkpoint was trained on it",
    ]
    moved = {**INFO, "data": {"source": "data.path=/d/b.jsonl", "fingerprint": "f3"}}
    assert resume_problems(summary(), moved, 8) == [
        "the data is data.path=/d/b.jsonl, not the data.path=/d/a.jsonl the checkpoint was "
        "trained on"
    ]


def test_a_checkpoint_from_before_the_data_was_recorded_still_resumes():
    older = {key: value for key, value in INFO.items() if key in ("model", "tokenizer")}
    assert resume_problems(summary(older), INFO, 8) == []
