"""The dry run's ``train.cpu_offload=true`` lever (components/planning/dry_run.py): planned for a
CUDA target (``dry_run_device=cuda``) where a layout does not fit, named only when it fits, with
its device memory per rank and the host memory it needs; never on the CPU (nothing moves), nor
where the layout's rules refuse offload (ep > 1); a frozen reference offloaded with the policy.
Plans made in-process from the real checks."""

from pathlib import Path

import pytest
import torch.distributed as dist

from components.planning.dry_run import _offload_levers, _step, dry_run, plan_layout
from components.planning.memory_model import Layout
from recipes.checks import check
from recipes.compose import compose, compose_dpo
from recipes.dpo_checks import check_dpo, prepare_dpo
from recipes.prepare import prepare

# one row of 2 × 48 positions a step (no accumulation): the state outweighs the activations
SHAPE = ["model.config.hidden_size=256", "model.config.intermediate_size=512"]
SHAPE += ["model.config.num_hidden_layers=8", "train.global_batch_size=2"]
SHAPE += ["train.micro_batch_size=2"]


def planned(folder: Path, *overrides: str):
    """(plan, step, layout) of a dry run of ``overrides``, as the recipe makes them."""
    cfg = compose(["dry_run=true", *SHAPE, *overrides])
    plan, _ = prepare(check(cfg, output_dir=str(folder)))
    train = plan.train
    layout = Layout(
        dims=plan.dims,
        micro_batch_size=train.micro_batch_size,
        activation_checkpointing=train.activation_checkpointing,
    )
    return plan, _step(plan), layout


@pytest.fixture
def fake_world_after():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_offload_is_named_when_it_fits_with_its_device_and_host_memory(tmp_path, fake_world_after):
    plan, step, layout = planned(tmp_path / "run", "dry_run_device=cuda")
    full = plan_layout(plan, step, layout)
    [lever] = _offload_levers(plan, step, layout, full.total)
    assert lever["change"] == "train.cpu_offload=true"
    # the device loses the shards, gradients and AdamW's state; the host holds them
    assert lever["total_gib"] < full.total - full.params - full.optimizer
    host = lever["host_gib"]
    assert host["per_rank"] > full.params + full.grads + full.optimizer
    assert (host["ranks_per_node"], host["per_node"]) == (1, host["per_rank"])
    assert _offload_levers(plan, step, layout, lever["total_gib"] * 0.99) == []  # no fit: none
    between = f"device_memory_gib={(lever['total_gib'] + full.total) / 2}"
    result = dry_run(planned(tmp_path / "plan", "dry_run_device=cuda", between)[0])
    assert result["fits"] is False and result["offload_levers"] == [lever]
    assert result["host_gib"] is None  # the run itself does not offload


def test_offload_moves_nothing_on_the_cpu(tmp_path, capsys, fake_world_after):
    plan, step, layout = planned(tmp_path / "run", "dry_run_device=cpu", "train.cpu_offload=true")
    assert _offload_levers(plan, step, layout, 1e9) == []
    result = dry_run(plan)
    assert result["host_gib"] is None and result["host_detail_gib"] == {}
    assert "train.cpu_offload=true moves nothing on the CPU" in capsys.readouterr().out
    cpu_plan = planned(tmp_path / "off", "dry_run_device=cpu")
    assert _offload_levers(*cpu_plan, 1e9) == []


def test_offload_is_never_named_with_expert_parallelism(tmp_path, fake_world_after):
    moe = ["model=qwen3_moe", "dp=2", "dry_run_device=cuda", "train.global_batch_size=4"]
    plan, step, layout = planned(tmp_path / "ep2", *moe, "ep=2")
    assert _offload_levers(plan, step, layout, 1e9) == []
    at_ep1 = planned(tmp_path / "ep1", *moe, "ep=1")
    assert [lever["change"] for lever in _offload_levers(*at_ep1, 1e9)] == [
        "train.cpu_offload=true"
    ]


def test_offload_moves_dpo_s_frozen_reference_to_the_host_too(tmp_path, fake_world_after):
    """The recipe gives the reference the run's train.cpu_offload: its weights leave the device
    as the policy's do (the policy's starting weights: as many bytes)."""
    overrides = ["dry_run=true", "dry_run_device=cuda", "train.cpu_offload=true", *SHAPE]
    cfg = compose_dpo([f"output_dir={tmp_path / 'run'}", *overrides])
    result = dry_run(prepare_dpo(check_dpo(cfg, None, None))[0])
    assert result["per_rank_gib"]["frozen"] == 0 and result["per_rank_gib"]["params"] == 0
    host = result["host_detail_gib"]
    assert host["frozen"] == host["params"] > 0
