"""What a resume does with settings changed since its checkpoint, through the real command line
(docs/checkpoints.md): DPO's reference and distillation's teacher are part of the objective, so a
resume against another one is one ``error:`` line before any rank starts, and the folder resumes
as before; their loss settings (``dpo.*``, ``distill.*``) are applied from the resumed step on,
named in a ``note:``. Each run stops after step 2 of 4 (``train.stop_after=2``) and resumes with
``checkpoint.resume=auto``; the resumed run's ``summary:`` line gives its own steps' losses."""

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.e2e.test_dpo import dpo
from tests.e2e.test_recipe_training import COMMON, REPO, metrics
from tests.saved_models import reference_folders

RESUME = "checkpoint.resume=auto"


def launch(script: str, output_dir: Path, *overrides: str, status: int = 0):
    """``recipes/SCRIPT.py`` with fine-tuning's small settings, 4 steps, into ``output_dir``."""
    command = [sys.executable, f"recipes/{script}.py", *COMMON, "train.max_steps=4"]
    command += [f"output_dir={output_dir}", *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == status, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    return result


def distill(output_dir: Path, *overrides: str, status: int = 0):
    return launch("distill", output_dir, *overrides, status=status)


def finetune(output_dir: Path, *overrides: str, status: int = 0):
    return launch("finetune", output_dir, *overrides, status=status)


def refusal(result) -> str:
    """The one line a refused run prints: an ``error:`` line, no traceback."""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot resume from ") and "Traceback" not in result.stdout
    return line


def summary(result) -> str:
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("summary: ")]
    return line


def test_a_dpo_resume_refuses_another_reference_and_notes_a_new_beta(tmp_path):
    """Stopped at step 2 against a reference folder: resuming against the policy's start (the
    reference the trial's resume fell back to) is refused naming both; against the same folder
    with ``dpo.beta=0.5`` it trains steps 3 and 4 with a note of the change."""
    folders = reference_folders(tmp_path / "models")
    run = tmp_path / "run"
    policy = ["model=pretrained", f"model.pretrained_path={folders['policy']}"]
    reference = f"dpo.reference_path={folders['reference']}"
    dpo(run, *policy, reference, "train.stop_after=2")
    line = refusal(dpo(run, *policy, "dpo.beta=0.5", RESUME, status=2))
    assert f"the reference (the policy's starting weights ({folders['policy']}), weights " in line
    assert f"trained against ({reference}, weights " in line
    resumed = dpo(run, *policy, reference, "dpo.beta=0.5", RESUME)
    note = "note: resuming from step 2 with changed settings, applied from step 3 on: "
    assert f"{note}dpo.beta 0.1 -> 0.5" in resumed.stdout + resumed.stderr
    records = metrics(run)
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    assert summary(resumed).startswith("summary: steps 3-4 of 4, ")
    assert f"loss {records[2]['loss']:.4f} -> {records[3]['loss']:.4f}" in summary(resumed)


def test_a_distill_resume_refuses_another_teacher_and_applies_new_loss_settings(tmp_path):
    """Stopped at step 2: a resume with a one-layer teacher is refused naming teacher.config; with
    ``distill.alpha=0.9 distill.temperature=3.0`` steps 3 and 4 are their loss, noted."""
    run = tmp_path / "run"
    distill(run, "train.stop_after=2")
    layer = "teacher.config.num_hidden_layers=1"
    line = refusal(distill(run, layer, RESUME, status=2))
    assert "the teacher (built from teacher.config={" in line and "'num_hidden_layers': 1" in line
    assert "'num_hidden_layers': 4" in line
    changed = ["distill.alpha=0.9", "distill.temperature=3.0"]
    resumed = distill(run, *changed, RESUME)
    said = "applied from step 3 on: distill.alpha 0.5 -> 0.9, distill.temperature 1.0 -> 3.0"
    assert said in resumed.stdout + resumed.stderr
    records = metrics(run)
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    for record in records[2:]:  # loss = alpha · CE + (1 − alpha) · T² · KL at the new settings
        mixed = 0.9 * record["ce_loss"] + 0.1 * 9.0 * record["kd_loss"]
        assert record["loss"] == pytest.approx(mixed, rel=1e-5)
    assert f"loss {records[2]['loss']:.4f} -> {records[3]['loss']:.4f}" in summary(resumed)


FIRST_DIM_ONLY = "state reshards along its first dimension only (torchao), and "
KEEPS = "(a dp, cp, pp or ep that keeps it works)"


def test_a_low_bit_optimizer_state_resumed_at_another_tp_is_refused(tmp_path):
    """torchao's 4-bit moments reshard along their first dimension only: a checkpoint of
    ``optim=adamw4bit`` at tp=1 (the tiny Llama's matmul weights hold the 4,096 values it
    quantizes) resumed at tp=2, which splits the row-parallel layers' second dimension, is one
    ``error:`` line naming tp and what does work, before any rank starts."""
    folder, lowbit = tmp_path / "run", ["optim=adamw4bit", "train.stop_after=2"]
    finetune(folder, *lowbit)
    line = refusal(finetune(folder, *lowbit, "tp=2", RESUME, status=2))
    assert line.endswith(
        f"tp 1 -> 2: torchao.optim.AdamW4bit's 4-bit {FIRST_DIM_ONLY}tp splits the row-parallel "
        f"layers along their second: resume with tp=1 {KEEPS}"
    )
    assert [record["step"] for record in metrics(folder)] == [1, 2]  # the folder is as it was


MOE = ["model=qwen3_moe", "optim=adamw8bit", "train.global_batch_size=8"]
MOE += ["train.micro_batch_size=2", "checkpoint.every_steps=2"]


@pytest.mark.sweep
def test_a_low_bit_expert_state_resumes_at_another_ep_but_not_another_ep_shard(tmp_path):
    """8-bit moments of experts split by expert (dim 0) resume at another ep: ep=2 -> ep=1 at
    dp=2 gives the uninterrupted run's steps 3 and 4 (within 1e-5). With moe.shard_experts each
    expert's rows (dim 1) are split over its ep_shard copies: a checkpoint at dp=4 ep=2
    (ep_shard 2) resumed at dp=2 ep=2 (ep_shard 1) is refused with one line; without the
    refusal it failed on every rank in torchao's slice. 3 runs of compiled 8-bit steps."""
    whole, step_2 = tmp_path / "whole", "checkpoints/step_00000002"
    finetune(whole, *MOE, "ep=2", "dp=2")
    finetune(tmp_path / "ep1", *MOE, "ep=1", "dp=2", f"checkpoint.resume={whole / step_2}")
    for ours, theirs in zip(metrics(tmp_path / "ep1"), metrics(whole)[2:], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    sharded = [*MOE, "moe.shard_experts=true", "train.stop_after=2"]
    finetune(tmp_path / "sharded", *sharded, "ep=2", "dp=4")
    resumed = finetune(tmp_path / "sharded", *sharded, "ep=2", "dp=2", RESUME, status=2)
    assert refusal(resumed).endswith(
        f"ep_shard 2 -> 1: torchao.optim.AdamW8bit's 8-bit {FIRST_DIM_ONLY}moe.shard_experts=true "
        f"splits each expert's rows over its ep_shard copies: resume with ep_shard = world size / "
        f"ep = 2 {KEEPS}"
    )


def test_another_recipes_run_is_not_resumed_and_precision_and_a_sources_split_are_seen(tmp_path):
    """A fine-tuning run's folder resumed by distill.py (which trained on: the trial's distill run
    went on from the fine-tuning loss) is refused naming both recipes; a mixture source's own
    val_fraction changed at resume (its split: records trained on would validate) is refused; a
    precision change is applied with a note."""
    run = tmp_path / "run"
    finetune(run, "train.stop_after=2", "checkpoint.every_steps=2")
    line = refusal(distill(run, RESUME, status=2))
    assert "the checkpoint is a recipes/finetune.py run's, not a recipes/distill.py one's" in line
    assert line.endswith(  # alone: the other recipe's data or keys are no news
        "resume it with recipes/finetune.py; to start recipes/distill.py from its weights, give "
        f"its run's export as a model (model=pretrained model.pretrained_path={run / 'hf'}, "
        "written when that run ends)"
    ), line
    resumed = finetune(run, RESUME, "train.precision=bf16-mixed")
    assert "train.precision fp32 -> bf16-mixed" in resumed.stdout, resumed.stdout
    mix = tmp_path / "mix"
    sources = "data.sources=[{name:a,weight:1,kind:generated,num_examples:200}]"
    finetune(mix, "data=mix", sources, "train.stop_after=2", "checkpoint.every_steps=2")
    moved = sources.replace("num_examples:200", "num_examples:200,val_fraction:0.2")
    line = refusal(finetune(mix, "data=mix", moved, RESUME, status=2))
    assert "data.sources' val_fraction is {'a': 0.2} but the checkpoint was written with" in line


def test_a_folder_without_a_checkpoint_is_not_advised_a_resume(tmp_path):
    """A run stopped before its first save (Ctrl-C) leaves its files and no checkpoint: the
    rerun's refusal does not advise checkpoint.resume=auto, which would be refused in turn."""
    run = tmp_path / "run"
    finetune(run, "train.stop_after=2")
    for checkpoint in (run / "checkpoints").iterdir():  # as if stopped before the first save
        shutil.rmtree(checkpoint)
    (line,) = finetune(run, status=2).stderr.strip().splitlines()
    assert "and no complete checkpoint to resume from; to keep it choose another" in line, line
    assert "checkpoint.resume=auto" not in line
