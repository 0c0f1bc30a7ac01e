"""Every layout the dry run may suggest passes the recipe's checks: the candidate filter and the
checks ask the same rules (``components/distributed/layout.py``), read from the same facts (the
model's sizes and experts, the optimizer), so a run refused at a layout is never told to take it.
The checks run in-process on the suggested overrides, as the recipe runs them before any rank."""

import pytest

from components.planning.dry_run import MAX_PLANNED, _candidates
from components.planning.memory_model import Layout
from components.runtime.problems import ConfigError
from recipes.checks import check
from recipes.compose import compose


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
    checked = check(compose(["dry_run=true", *overrides]), output_dir=str(folder))
    train = checked.train
    layout = Layout(
        dims=checked.dims,
        micro_batch_size=train.micro_batch_size,
        activation_checkpointing=train.activation_checkpointing,
    )
    return [words for words, _ in _candidates(checked, layout)[:MAX_PLANNED]]


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
