"""``recipes/distill.py`` as a user runs it: the real command line in a subprocess, the default
tiny Llama student and its tiny Llama teacher (twice its size), each layout against its tp=1
twin: tp=2, dp=2 × tp=2 with sp, cp=2, and a Qwen3-MoE student at tp=2 ep=2. fp32 on the CPU: a
layout changes only the order of sums, so each step's loss, CE and KL agree within 1e-5 of the
loss. One module fixture trains each configuration once; the metrics and the export are read
from it."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.e2e.test_recipe_training import recipe

SCRIPT = "recipes/distill.py"
STEPS = 4
NAMES = ("loss", "ce_loss", "kd_loss")
RUNS = {
    "tp1": ["tp=1", "checkpoint.export=true"],
    "tp2": ["tp=2"],
    "dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"],
    "cp2": ["cp=2"],
    "moe_tp1": ["model=qwen3_moe", "tp=1"],
    "moe_tp2_ep2": ["model=qwen3_moe", "tp=2", "ep=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("distill")
    steps = [f"train.max_steps={STEPS}", "distill.temperature=2.0"]
    return {
        name: recipe(root / name, *steps, *overrides, script=SCRIPT)
        for name, overrides in RUNS.items()
    } | {"root": root}


def agree(got: list[dict], want: list[dict]) -> float:
    """The largest difference of the distillation metrics, step by step, relative to the step's
    loss: the KL of two near-uniform random models is a small difference of large sums (its
    fp32 rounding alone is ~1e-5 of itself), so each term is held to the loss's scale."""
    assert [row["step"] for row in got] == [row["step"] for row in want] == [1, 2, 3, 4]
    return max(
        abs(a[name] - b[name]) / abs(b["loss"])
        for a, b in zip(got, want, strict=True)
        for name in NAMES
    )


@pytest.mark.parametrize(
    ("name", "twin"),
    [("tp2", "tp1"), ("dp2_tp2_sp", "tp1"), ("cp2", "tp1"), ("moe_tp2_ep2", "moe_tp1")],
)
def test_each_layout_distils_as_its_tp1_twin(runs, name, twin):
    assert agree(runs[name], runs[twin]) <= 1e-5


def test_the_metrics_are_the_loss_and_its_two_terms(runs):
    first, last = runs["tp1"][0], runs["tp1"][-1]
    assert first["loss"] == pytest.approx(
        0.5 * first["ce_loss"] + 0.5 * 4.0 * first["kd_loss"], rel=1e-6
    )
    assert first["kd_loss"] > 0 and last["loss"] < first["loss"]


def test_the_student_is_exported(runs):
    student = AutoModelForCausalLM.from_pretrained(Path(runs["root"]) / "tp1" / "hf")
    assert student.config.hidden_size == 64  # the student's, not the teacher's 128
