"""Which layout changes a quantized optimizer state (torchao's 8/4-bit, resharded along its first
dimension only) may resume across: the cuts past the first dimension a checkpoint records."""

from recipes.outputs import layout_cuts


def test_only_tp_and_ep_shard_of_sharded_experts_cut_past_the_first_dimension():
    plain = layout_cuts(tp=2, ep=1, ep_shard=4, shard_experts=False)
    assert plain == {"tp": 2, "ep_shard": 1}
    # experts split by expert (dim 0) over another ep, copies replicated: the same cuts
    assert layout_cuts(tp=2, ep=2, ep_shard=2, shard_experts=False) == plain
    assert layout_cuts(tp=2, ep=4, ep_shard=1, shard_experts=False) == plain
    # moe.shard_experts splits each expert's rows (dim 1) over its ep_shard copies
    assert layout_cuts(tp=2, ep=2, ep_shard=2, shard_experts=True) == {"tp": 2, "ep_shard": 2}
    assert (
        layout_cuts(tp=1, ep=1, ep_shard=4, shard_experts=True)["ep_shard"] == 1
    )  # no experts split
