"""Keys a run's layout does not read are each said in a note, never silently ignored."""

import pytest

from components.distributed.layout import resolve_parallel_dims
from recipes.checks import unread_keys
from recipes.compose import compose
from recipes.validate import validate

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def unread(overrides: list[str], world_size: int = 1, **sizes: int) -> list[str]:
    settings = validate(compose(overrides))
    return unread_keys(settings, resolve_parallel_dims(world_size, **sizes))


@pytest.fixture
def local(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def test_a_layout_that_reads_every_key_notes_nothing(local):
    assert unread(["tp=2", "sp=true", "nproc=2"], 2, tp=2) == []
    assert unread(["dry_run=true", "device_memory_gib=80", "dry_run_device=cuda"]) == []
    assert unread(["model=qwen3_moe", "ep=2", "moe.shard_experts=true"], 4, ep=2) == []


def test_sp_at_tp_1_and_device_memory_without_a_dry_run_are_noted(local):
    assert unread(["sp=true", "cp=2"], 2, cp=2) == [
        "sp=true changes nothing at tp=1: sequence parallelism splits the norms' sequence over "
        "the TP ranks, and there is one"
    ]
    assert unread(["device_memory_gib=80"]) == [
        "device_memory_gib=80 is read by dry_run=true only (whether the planned layout fits): "
        "this run trains on the device it has"
    ]
    assert unread(["dry_run_device=cuda"]) == [
        "dry_run_device=cuda is read by dry_run=true only (the device the plan is for): this run "
        "trains on the device it has"
    ]


def test_sharding_experts_with_one_copy_each_is_noted(local):
    at_world = unread(["model=qwen3_moe", "ep=2", "moe.shard_experts=true"], 2, ep=2)
    assert at_world == [
        "moe.shard_experts=true changes nothing at ep=2 on 2 ranks: each expert has one copy, "
        "with nothing to shard it over"
    ]
    assert "changes nothing at ep=1" in unread(["model=qwen3_moe", "moe.shard_experts=true"])[0]


def test_nproc_under_torchrun_is_noted(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert unread(["nproc=4"], 2) == [
        "nproc=4 is not read under torchrun: torchrun started 2 ranks here (its --nproc-per-node)"
    ]


def test_a_replica_check_with_no_copies_to_compare_is_noted(local):
    assert unread(["debug.check_replicas_every=1"], 2, dp=2) == [
        "debug.check_replicas_every=1 compares nothing here: at tp=1 there are no TP replicas (nor "
        "experts copied over ep_shard)"
    ]
    assert unread(["debug.check_replicas_every=1", "model=qwen3_moe", "ep=2"], 4, ep=2) == []


def test_a_fp8_recipe_without_fp8_is_noted(local):
    assert unread(["train.fp8_recipe=rowwise", "train.precision=fp8"]) == []
    assert unread(["train.fp8_recipe=rowwise"]) == [
        "train.fp8_recipe=rowwise is read with train.precision=fp8 only: this run has none"
    ]


def test_pipeline_keys_at_pp_1_are_noted_one_line_each(local):
    assert unread(["pp_schedule=interleaved_1f1b", "pp_stages_per_rank=2"]) == [
        "pp_schedule=interleaved_1f1b is read with pp > 1 only: this run has pp=1",
        "pp_stages_per_rank=2 is read with pp > 1 only: this run has pp=1",
    ]
    assert unread(["pp_schedule=gpipe"], 2, tp=2) == [
        "pp_schedule=gpipe is read with pp > 1 only: this run has pp=1"
    ]
    assert unread(["pp=2", "pp_schedule=gpipe"], 2, pp=2) == []
    # a dry run may suggest a pp, and prices its schedule
    assert unread(["dry_run=true", "pp_schedule=interleaved_1f1b", "pp_stages_per_rank=2"]) == []
