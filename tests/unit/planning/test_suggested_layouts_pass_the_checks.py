"""Every layout the dry run may suggest passes the recipe's checks: the candidate filter and the
checks ask the same rules (``components/distributed/layout.py``), read from the same facts (the
model's sizes and experts, the optimizer; DPO's reference and distillation's teacher beside it),
so a run refused at a layout is never told to take it.
The checks run in-process on the suggested overrides, as the recipe runs them before any rank."""

import pytest
from transformers import AutoTokenizer

from components.planning.dry_run import MAX_PLANNED, _candidates
from components.planning.memory_model import Layout
from components.runtime.problems import ConfigError
from recipes.checks import check
from recipes.compose import compose, compose_distill, compose_dpo
from recipes.distill_checks import check_distillation
from recipes.dpo_checks import check_dpo
from recipes.tiny_models import tiny_config
from tests.saved_models import SIZES, reference_folders, save_model
from tests.unit.recipes.test_distill_checks import refusals_of
from tests.unit.recipes.test_dpo_checks import policy_and


def refusals(overrides: list[str], folder) -> list[str]:
    """The checks' lines for ``overrides`` (a dry run's), none when they pass."""
    try:
        check(compose(["dry_run=true", *overrides]), output_dir=str(folder))
    except ConfigError as error:
        return [problem.message for problem in error.problems]
    return []


def suggestions(overrides: list[str], folder) -> list[str]:
    """The changes the dry run plans for ``overrides`` when the layout does not fit: its
    candidates, as many as it plans (``MAX_PLANNED``), from the run the checks made."""
    return recipe_suggestions(compose, check, overrides, folder)


BATCH_12 = ["train.global_batch_size=12"]  # 6 ranks' micro-batches of 2

SITUATIONS = {
    # foreach=true is refused at tp > 1 without dp (DTensors beside plain replicas)
    "foreach": (["+optim.foreach=true", "dp=2", "train.micro_batch_size=4"], ["tp=2 dp=1"], "cp=2"),
    # tp=4 does not divide intermediate_size 130, tp=8 not the 4 KV heads: tp=2 only
    "tp sizes": (
        ["dp=8", "train.micro_batch_size=2", "model.config.intermediate_size=130"],
        ["tp=4 dp=2", "tp=8 dp=1"],
        "tp=2 dp=4",
    ),
    # fp8's matmuls: 16 tokens per cp rank (seq_len 48 runs at cp=1, not cp=2), and 16 output
    # features per rank (k_proj's 32 split 8 a rank at tp=4): the model's structure at that tp
    "fp8": (
        ["train.precision=fp8", "dp=4", "train.micro_batch_size=4"],
        ["cp=2 dp=2", "tp=4 dp=1"],
        "tp=2",
    ),
    # context parallelism computes attention with SDPA: the eager kernel runs at cp=1 only
    "eager attention": (
        ["model.attn_implementation=eager", "dp=2", "train.micro_batch_size=4"],
        ["cp=2 dp=1"],
        "tp=2",
    ),
    # an MoE model at ep=4 takes neither cp nor pp
    "moe": (
        ["model=qwen3_moe", "ep=4", "dp=4", "train.micro_batch_size=4"],
        ["cp=2 dp=2", "pp=2 dp=2"],
        "tp=2",
    ),
    # QLoRA's NF4 tiles, as many on each of FSDP's shards: the tiny Llama's q_proj has 16 tiles,
    # which 2 shards divide and 6 (no HSDP replicas left) do not
    "qlora tiles": (
        ["peft=qlora", "dp_replicate=3", "dp_shard=2", "train.micro_batch_size=2"] + BATCH_12,
        ["dp_replicate=1 dp_shard=6"],
        "tp=2",
    ),
}


@pytest.mark.parametrize("name", SITUATIONS)
def test_every_suggested_layout_passes_the_checks(name, tmp_path):
    overrides, refused, kept = SITUATIONS[name]
    words = suggestions(overrides, tmp_path)
    for layout in refused:
        assert not any(layout in change for change in words), layout
        assert refusals([*overrides, *layout.split()], tmp_path) != [], layout  # the checks' no
    assert any(kept in change for change in words)
    failed = {change: refusals([*overrides, *change.split()], tmp_path) for change in words}
    assert {change: lines for change, lines in failed.items() if lines} == {}


def recipe_suggestions(compose, check, overrides: list[str], folder) -> list[str]:
    """:func:`suggestions` of a recipe (``compose``, its ``check``: DPO's, distillation's)."""
    checked = check(
        compose([f"output_dir={folder / 'run'}", "dry_run=true", *overrides]), None, None
    )
    train = checked.train
    layout = Layout(
        dims=checked.dims,
        micro_batch_size=train.micro_batch_size,
        activation_checkpointing=train.activation_checkpointing,
    )
    return [words for words, _ in _candidates(checked, layout)[:MAX_PLANNED]]


# a frozen model of 2 KV heads beside the tiny Llama's 4: tp=4 splits the trained model alone
TWO_KV_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
WORLD = ["dp=8", "train.micro_batch_size=2"]


def test_the_dry_run_suggests_no_tp_the_teacher_cannot_take(tmp_path):
    teacher = [f"teacher.config.{key}={value}" for key, value in TWO_KV_HEADS.items()]
    words = recipe_suggestions(compose_distill, check_distillation, [*WORLD, *teacher], tmp_path)
    assert any("tp=2 dp=4" in change for change in words), words
    assert not any("tp=4" in change for change in words), words
    assert any("tp=4 dp=2" in change for change in suggestions(WORLD, tmp_path))  # the student's
    said = refusals_of(compose_distill, check_distillation, tmp_path, *WORLD, *teacher, "tp=4")
    assert said and all(line.startswith("teacher") for line in said), said


def test_the_dry_run_suggests_no_tp_the_dpo_reference_cannot_take(tmp_path):
    folders = reference_folders(tmp_path / "models")  # the policy: 2 KV heads, tp=2 splits it
    tokenizer = AutoTokenizer.from_pretrained(folders["policy"], trust_remote_code=False)
    config = tiny_config("llama", vocab_size=len(tokenizer), **{**SIZES, "num_key_value_heads": 1})
    reference = save_model(tmp_path / "one_kv_head", config, tokenizer)
    policy = policy_and(folders, "policy")[:-1]
    alone = recipe_suggestions(compose_dpo, check_dpo, [*WORLD, *policy], tmp_path)
    assert any("tp=2 dp=4" in change for change in alone), alone
    beside = [*WORLD, *policy, f"dpo.reference_path={reference}"]
    words = recipe_suggestions(compose_dpo, check_dpo, beside, tmp_path)
    assert not any("tp=" in change for change in words), words
    said = refusals_of(compose_dpo, check_dpo, tmp_path, *beside, "tp=2")
    assert said and all(line.startswith("dpo.reference_path") for line in said), said


def test_the_dry_run_suggests_no_degree_the_recipe_does_not_run(tmp_path):
    """DPO runs cp and pp at 1 only, distillation pp: their dry runs suggest neither, which
    fine-tuning's does at the same layout, and the checks refuse what is left out."""
    assert any("cp=2" in change for change in suggestions(WORLD, tmp_path))
    assert any("pp=2" in change for change in suggestions(WORLD, tmp_path))
    words = recipe_suggestions(compose_dpo, check_dpo, WORLD, tmp_path)
    assert any("tp=2" in change for change in words), words
    assert not any("cp=" in change or "pp=" in change for change in words), words
    said = refusals_of(compose_dpo, check_dpo, tmp_path, *WORLD, "pp=2", "dp=4")
    assert said == ["pp=2 is not run by dpo.py: no pipeline schedule runs DPO's two forwards: "
                    "use pp=1"], said  # fmt: skip
    words = recipe_suggestions(compose_distill, check_distillation, WORLD, tmp_path)
    assert any("cp=2" in change for change in words), words
    assert not any("pp=" in change for change in words), words


def test_the_dry_run_suggests_no_cp_an_moe_teacher_cannot_take(tmp_path):
    """A dense student takes cp; an MoE teacher beside it does not (its checks' line)."""
    assert any("cp=2" in change for change in suggestions(WORLD, tmp_path))
    moe = [*WORLD, "teacher.family=qwen3_moe"]
    words = recipe_suggestions(compose_distill, check_distillation, moe, tmp_path)
    assert words and not any("cp=" in change for change in words), words
    said = refusals_of(compose_distill, check_distillation, tmp_path, *moe, "cp=2", "dp=4")
    assert "cp=2 with an MoE teacher is not supported yet: use cp=1" in said, said
