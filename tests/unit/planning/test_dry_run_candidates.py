"""The dry run's suggestion search with cp: a larger tp or cp keeps the world (dp shrinks), a cp
the row cannot split into 2·cp chunks is never suggested, nor cp for an MoE model, nor a tp that
ep does not divide for experts given tokens already routed; pp only where the settings let a run
pipeline."""

from types import SimpleNamespace

from components.distributed.layout import ModelFacts, OptimizerFacts, ParallelDims, Workload
from components.planning.dry_run import _candidates
from components.planning.memory_model import Layout


def plan_of(
    seq_len: int, moe: bool = False, compile: bool = False, routed: str | None = None
) -> SimpleNamespace:
    work = Workload(global_batch_size=8, micro_batch_size=1, seq_len=seq_len, compile=compile)
    return SimpleNamespace(
        model=SimpleNamespace(sequence_parallel=False, config=SimpleNamespace()),
        workload=work,
        model_facts=ModelFacts(name="tiny", moe=moe, layers=4, routed_experts=routed),
        optimizer_facts=OptimizerFacts(target="torch.optim.AdamW"),
    )


def layout(**degrees: int) -> Layout:
    return Layout(dims=ParallelDims(**degrees), micro_batch_size=2, activation_checkpointing="full")


LAYOUT = layout(dp_shard=4, cp=2)


def test_a_larger_tp_or_cp_keeps_the_world():
    found = dict(_candidates(plan_of(4096), LAYOUT))
    assert found["tp=2 dp=2"] == layout(dp_shard=2, cp=2, tp=2)
    assert found["cp=4 dp=2"] == layout(dp_shard=2, cp=4)
    assert found["tp=2 cp=4 dp=1"].dims.dp == 1
    assert all(c.dims.world_size == 8 for c in found.values())


def test_cp_is_suggested_only_where_the_row_splits_and_never_for_moe():
    words = [word for word, _ in _candidates(plan_of(20), LAYOUT)]
    assert "cp=4 dp=2" not in words and "cp=8 dp=1" not in words  # 20 % 8, 20 % 16
    at_cp1 = layout(dp_shard=8)  # an MoE model runs at cp=1 only
    moe = [word for word, _ in _candidates(plan_of(4096, moe=True), at_cp1)]
    assert not any("cp=" in word for word in moe) and "tp=2 dp=4" in moe


def test_pp_and_fewer_hsdp_replicas_are_suggested_where_they_fit():
    hsdp = Layout(
        dims=ParallelDims(dp_replicate=2, dp_shard=4),
        micro_batch_size=1,
        activation_checkpointing="full",
    )
    words = [word for word, _ in _candidates(plan_of(4096), hsdp)]
    assert "pp=2 dp=4 dp_shard=2" in words and "dp_replicate=1 dp_shard=8" in words
    assert "pp=4 dp=2 dp_shard=1" in words
    assert not any("pp=8" in word for word in words)  # 8 stages of a 4-layer model (+2 units)
    compiled = [word for word, _ in _candidates(plan_of(4096, compile=True), hsdp)]
    assert not any("pp=" in word for word in compiled)  # refused with train.compile=true
    assert "dp_replicate=1 dp_shard=8" in compiled


def test_experts_given_tokens_already_routed_get_only_a_tp_that_ep_divides():
    routed = "model.layers.0.feed_forward.experts (Llama4TextExperts)"  # Llama 4's, as found
    at_ep4 = layout(dp_shard=8, ep=4)
    words = [word for word, _ in _candidates(plan_of(4096, moe=True, routed=routed), at_ep4)]
    assert "tp=2 dp=4" not in words  # ep=4 does not divide tp=2
    assert "tp=4 dp=2" in words and "tp=8 dp=1" in words
    taking_routing = [word for word, _ in _candidates(plan_of(4096, moe=True), at_ep4)]
    assert "tp=2 dp=4" in taking_routing
