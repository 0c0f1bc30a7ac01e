"""``recipes/distill.py`` as a user runs it: the real command line in a subprocess, the default
tiny Llama student and its tiny Llama teacher (twice its size), each layout against its tp=1
twin: tp=2, dp=2 × tp=2 with sp, cp=2, a Qwen3-MoE student at tp=2 ep=2, and the Llama student
with a Qwen3-MoE teacher at tp=2 ep=2 (the teacher's experts split over ep, the dense student's
layers not), and cp=2 with a teacher whose attention masks are not the student's (Mistral with a
sliding window; Qwen3's layer types). fp32 on the CPU: a layout changes only the order of sums, so
each step's loss, CE and KL agree within 1e-5 of the loss. One module fixture trains each
configuration once; the metrics and the export are read from it. make test runs cp=2 (and with
the Mistral teacher) and both MoE layouts at tp=2 ep=2 (the vocabulary split by tp as well); plain
tp=2, the 4-rank dp=2 × tp=2 sp and the Qwen3 teacher at cp=2 run under ``-m sweep`` only."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.e2e.test_recipe_training import recipe
from tests.selection import selected_params

SCRIPT = "recipes/distill.py"
STEPS = 4
NAMES = ("loss", "ce_loss", "kd_loss")
STEPS_AT_T2 = [f"train.max_steps={STEPS}", "distill.temperature=2.0"]
RUNS = {
    "tp1": ["tp=1", "checkpoint.export=true"],
    "tp2": ["tp=2"],
    "dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"],
    "cp2": ["cp=2"],
    "moe_tp1": ["model=qwen3_moe", "tp=1"],
    "moe_tp2_ep2": ["model=qwen3_moe", "tp=2", "ep=2"],
    "moe_teacher_tp1": ["teacher.family=qwen3_moe", "tp=1"],
    "moe_teacher_tp2_ep2": ["teacher.family=qwen3_moe", "tp=2", "ep=2"],
    # the teacher's masks are not the student's: a sliding window, layer types of its own
    "window_teacher_tp1": ["teacher.family=mistral", "+teacher.config.sliding_window=8"],
    "window_teacher_cp2": ["teacher.family=mistral", "+teacher.config.sliding_window=8", "cp=2"],
    "qwen3_teacher_tp1": ["teacher.family=qwen3"],
    "qwen3_teacher_cp2": ["teacher.family=qwen3", "cp=2"],
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, list[dict]]:
    """tp=1 (exported) and each selected layout with its twin."""
    root = tmp_path_factory.mktemp("distill")
    names = {"tp1", *selected_params(request, "name"), *selected_params(request, "twin")}
    return {
        name: recipe(root / name, *STEPS_AT_T2, *overrides, script=SCRIPT)
        for name, overrides in RUNS.items()
        if name in names
    } | {"root": root}


def agree(got: list[dict], want: list[dict], steps: tuple[int, ...] = (1, 2, 3, 4)) -> float:
    """The largest difference of the distillation metrics, step by step, relative to the step's
    loss: the KL of two near-uniform random models is a small difference of large sums (its
    fp32 rounding alone is ~1e-5 of itself), so each term is held to the loss's scale."""
    assert [row["step"] for row in got] == [row["step"] for row in want] == list(steps)
    return max(
        abs(a[name] - b[name]) / abs(b["loss"])
        for a, b in zip(got, want, strict=True)
        for name in NAMES
    )


@pytest.mark.parametrize(
    ("name", "twin"),
    [
        ("cp2", "tp1"),
        ("moe_tp2_ep2", "moe_tp1"),
        ("moe_teacher_tp2_ep2", "moe_teacher_tp1"),
        ("window_teacher_cp2", "window_teacher_tp1"),
        pytest.param("qwen3_teacher_cp2", "qwen3_teacher_tp1", marks=pytest.mark.sweep),
        pytest.param("tp2", "tp1", marks=pytest.mark.sweep),
        pytest.param("dp2_tp2_sp", "tp1", marks=pytest.mark.sweep),
    ],
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


def test_resume_at_another_tp_equals_the_uninterrupted_run(runs, tmp_path):
    """Stopped after step 2 at tp=2 (a checkpoint of the student and its optimizer; the teacher
    is rebuilt from its config), resumed at tp=1: steps 3 and 4 are the uninterrupted run's."""
    interrupted, steps = tmp_path / "interrupted", STEPS_AT_T2
    recipe(
        interrupted, *steps, "tp=2", "checkpoint.every_steps=2", "train.stop_after=2", script=SCRIPT
    )
    resumed = recipe(interrupted, *steps, "checkpoint.resume=auto", script=SCRIPT)
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    assert agree(resumed[2:], runs["tp1"][2:], steps=(3, 4)) <= 1e-5
