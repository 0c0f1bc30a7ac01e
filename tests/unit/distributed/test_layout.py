"""The layout owns its rules: one rule changed in ``components/distributed/layout.py`` changes what
the recipe's checks refuse and what the dry run suggests, with nothing else touched."""

from types import SimpleNamespace

import pytest

from components.distributed import layout
from components.distributed.layout import (
    Degrees,
    ModelFacts,
    OptimizerFacts,
    ParallelDims,
    Workload,
    resolve_parallel_dims,
)
from components.planning.dry_run import _candidates
from components.planning.memory_model import Layout
from recipes.checks import check_sizes
from recipes.compose import compose
from recipes.plan import workload
from recipes.validate import validate

OVERRIDES = ["cp=2", "train.seq_len=52"]  # 52 splits into 2 × cp = 4 chunks, not into 8


def refused_by_the_checks() -> list[str]:
    _, found = check_sizes(validate(compose(OVERRIDES)), "cpu")
    return [problem.message for problem in found]


def suggested_by_the_dry_run() -> list[str]:
    """The dry run's candidates from the same settings at cp=1 on 2 ranks."""
    settings = validate(compose(OVERRIDES))
    plan = SimpleNamespace(
        model=SimpleNamespace(sequence_parallel=False, config=SimpleNamespace()),
        workload=workload(settings),
        model_facts=ModelFacts(name="llama", moe=False, layers=2),
        optimizer_facts=OptimizerFacts(target="torch.optim.AdamW"),
    )
    at_cp1 = Layout(
        dims=ParallelDims(dp_shard=2), micro_batch_size=1, activation_checkpointing="full"
    )
    return [words for words, _ in _candidates(plan, at_cp1)]


def test_one_rule_changed_in_the_layout_changes_the_checks_and_the_dry_run(monkeypatch):
    assert refused_by_the_checks() == []
    assert "cp=2 dp=1" in suggested_by_the_dry_run()
    monkeypatch.setattr(layout.ParallelDims, "sequence_multiple", lambda dims: 4 * dims.cp)
    assert refused_by_the_checks() == [
        "train.seq_len (52) must be divisible by 8 with cp=2 (each cp rank holds two of 2 × cp "
        "equal chunks): use e.g. train.seq_len=48"
    ]
    assert "cp=2 dp=1" not in suggested_by_the_dry_run()


def test_every_problem_is_its_own_line():
    with pytest.raises(layout.LayoutError) as raised:
        resolve_parallel_dims(6, tp=4, ep=4)
    assert raised.value.lines == [
        "world size 6 is not divisible by tp=4",
        "world size 6 is not divisible by ep=4",
    ]


def test_the_default_world_on_the_cpu_and_on_gpus():
    work = Workload(global_batch_size=8, micro_batch_size=1, seq_len=64)
    assert Degrees(tp=2, cp=2).default_world(work) == (4, None)
    assert Degrees(dp=3, tp=2).default_world(work, gpus=8) == (6, None)
    world, note = Degrees(tp=2).default_world(work, gpus=6)
    assert world == 4 and note.startswith("note: nproc=4 of the 6 visible GPUs")
    assert Degrees(tp=2, ep=4).least_world() == 4


def test_the_meshes_are_named_by_purpose(fake_world):
    meshes = resolve_parallel_dims(8, tp=2, cp=2, ep=4).build_meshes("cpu")
    assert meshes.world.mesh_dim_names == ("dp", "cp", "tp")
    assert (meshes.batch.size(), meshes.loss.size(), meshes.fsdp.size()) == (2, 4, 4)
    assert meshes.experts.mesh_dim_names == ("ep_shard", "ep")
    assert resolve_parallel_dims(8, tp=2).build_meshes("cpu").experts is None


def test_cpu_offload_is_a_layout_rule_refused_with_experts_or_pipeline_stages():
    """FSDP2's offload policy moves what FSDP holds: experts split over ep are not, and a
    pipeline stage runs on its parameters' device; other layouts take it
    (tests/e2e/test_cpu_offload.py), and
    FSDP then wraps the model at dp=1 too, so foreach meets no plain replica at tp=2."""
    work = Workload(global_batch_size=8, micro_batch_size=1, seq_len=64, cpu_offload=True)
    [problem] = ParallelDims(tp=2, ep=2).problems(work)
    assert problem.key == "train.cpu_offload"
    assert problem.message.startswith("train.cpu_offload=true is not supported with ep=2: the")
    assert ParallelDims(tp=2, ep=1).problems(work) == []
    [staged] = ParallelDims(pp=2).problems(work)
    assert staged.message.startswith("train.cpu_offload=true is not supported with pp=2 yet: a")
    kept = Workload(global_batch_size=8, micro_batch_size=1, seq_len=64)
    assert ParallelDims(tp=2, ep=2).problems(kept) == []
    foreach = OptimizerFacts(target="torch.optim.AdamW", foreach=True)
    assert ParallelDims(tp=2).optimizer_problems(foreach, work) == []
    assert ParallelDims(tp=2).fsdp_wraps(cpu_offload=True)
    [refused] = ParallelDims(tp=2).optimizer_problems(foreach, kept)
    assert refused.message.startswith("optim.foreach=true at tp=2 without data parallelism")
