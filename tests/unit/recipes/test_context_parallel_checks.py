"""The cp key's checks: one problem per bad value, each naming what would work."""

import pytest
import torch
from transformers import BartConfig, BltConfig, GPTJConfig, LlamaConfig

from components.distributed.context_parallel import CpLayout, CpShard, attention_problems, running
from components.distributed.layout import resolve_parallel_dims
from components.models.load import sequence_problems
from recipes.checks import check_sizes
from recipes.compose import compose
from recipes.validate import SchemaError, validate


def problems_of(overrides: list[str]) -> list[str]:
    _, found = check_sizes(validate(compose(overrides)), "cpu")
    return [f"{problem.key}: {problem.message}" for problem in found]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["cp=2", "train.seq_len=50"],
            "train.seq_len: train.seq_len (50) must be divisible by 2 × cp (4)",
        ),
        (
            ["cp=2", "tp=4", "sp=true", "train.seq_len=36"],
            "train.seq_len (36) must be divisible by 8",
        ),
        (["cp=3", "nproc=4"], "nproc: world size 4 is not divisible by cp=3 × tp=1"),
        (["cp=2", "train.compile=true"], "train.compile=true with cp=2 is not supported yet"),
    ],
)
def test_a_bad_cp_layout_is_one_problem(overrides, expected):
    found = problems_of(overrides)
    assert len(found) == 1 and expected in found[0], found


def test_a_layout_that_fits_has_no_problem():
    assert problems_of(["cp=2", "tp=2", "sp=true", "train.seq_len=48"]) == []


def test_a_dry_run_plans_cp():
    assert problems_of(["cp=2", "dry_run=true"]) == []


def test_cp_must_be_a_positive_integer():
    with pytest.raises(SchemaError, match="cp=0 is not valid: use a positive integer, e.g. cp=2"):
        validate(compose(["cp=0"]))


def test_micro_batches_are_padded_to_whole_chunks():
    assert resolve_parallel_dims(1).pad_multiple() == 8
    assert resolve_parallel_dims(4, tp=4, sp=True).pad_multiple() == 32
    assert resolve_parallel_dims(4, cp=4).pad_multiple() == 8
    assert resolve_parallel_dims(3, cp=3).pad_multiple() == 24
    assert resolve_parallel_dims(8, tp=2, cp=4, sp=True).pad_multiple() == 16


@pytest.mark.parametrize(("config", "refused"), [(GPTJConfig, True), (LlamaConfig, False)])
def test_attention_outside_transformers_interface_is_refused(config, refused):
    """GPT-J computes its attention itself: context parallelism, which replaces the interface's
    function, would leave each rank attending to its own tokens only."""
    found = attention_problems(config(), 2)
    assert found == (
        [
            "cp=2 with model type 'gptj' is not supported: its attention does not go through "
            "transformers' attention interface, which context parallelism replaces: use cp=1"
        ]
        if refused
        else []
    )


def test_a_shard_no_attention_layer_computed_is_an_error():
    positions = torch.arange(8)
    layout = CpLayout(queries=positions[:4], keys=positions, position_ids=positions[None])
    shard = CpShard(
        input_ids=positions[None, :4],
        targets=positions[None, :4],
        position_ids=positions[None, :4],
        layout=layout,
        group=None,
    )
    with pytest.raises(RuntimeError, match="no attention layer of the model went through"):
        with running(shard):
            pass


def test_a_model_that_numbers_its_own_positions_refuses_cp_and_packing():
    """BART's causal LM takes no position ids: at cp=2 each rank would number its shard from 0
    (measured before: 6.0e-2 from tp=1), and packed examples would attend to each other."""
    assert sequence_problems(BartConfig(), cp=2, packing=True) == [
        "cp=2 with model type 'bart' is not supported: its forward takes no position ids and "
        "numbers a rank's share of the sequence from 0: use cp=1",
        "train.packing=true with model type 'bart' is not supported: its forward takes no "
        "position ids, so the examples packed in a row would attend to each other: use "
        "train.packing=false",
    ]
    assert sequence_problems(BartConfig(), cp=1, packing=False) == []
    assert sequence_problems(LlamaConfig(), cp=2, packing=True) == []


def test_a_model_whose_forward_a_sequence_shard_cannot_run_refuses_cp():
    """BLT cross-attends between bytes and their patches (at cp=2 a rank failed with a shape
    mismatch in the coverage sweep): one line, from the models' table."""
    (found,) = sequence_problems(BltConfig(), cp=2, packing=False)
    assert found.startswith("cp=2 with model type 'blt' is not supported: its local encoder")
    assert sequence_problems(BltConfig(), cp=1, packing=False) == []
