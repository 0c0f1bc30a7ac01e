"""Dropout masks at tp=2 on a Hugging Face model (Seed-OSS: attention and residual dropout 0.1),
recorded at every ``nn.functional.dropout`` call of one training forward on each rank: the
residual stream, replicated over TP, drops the same elements on both ranks; attention over each
rank's heads drops its own (and with sequence parallelism so does the residual stream, split by
tokens); the stream every rank shares is left where it would be on each rank.
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import SeedOssConfig

from components.distributed.tp_dropout import has_dropout, shard_dropout_masks
from components.distributed.tp_plan import apply_tp_plan
from components.models import build_causal_lm
from components.models.families import plan_for
from tests.harness import mesh
from tests.saved_models import SIZES

CONFIG = dict(SIZES, head_dim=16, vocab_size=256, attention_dropout=0.1, residual_dropout=0.1)


def check_masks(rank, world_size, sequence_parallel):
    config = SeedOssConfig(**CONFIG, attn_implementation="eager")  # its dropout is a call
    model = build_causal_lm(config, seed=0)
    tp = mesh((world_size,), ("tp",))
    apply_tp_plan(model, tp, plan_for(config, sequence_parallel, model), config, sequence_parallel)
    assert has_dropout(model)
    shard_dropout_masks(model, tp, sequence_parallel, torch.device("cpu"))
    masks, dropout = [], nn.functional.dropout

    def recording(tensor, p=0.5, training=True, inplace=False):
        output = dropout(tensor, p, training, inplace)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in (tensor, output)]
        masks.append((local[0] != 0, local[1] == 0))  # kept by softmax's causal mask; dropped
        return output

    torch.manual_seed(0)  # as join_world seeds every rank
    nn.functional.dropout = recording
    try:
        model.train()(input_ids=torch.arange(32).reshape(2, 16))
    finally:
        nn.functional.dropout = dropout
    return masks, torch.rand(4)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_replicated_regions_share_masks_and_sharded_regions_draw_their_own(
    ranks2, sequence_parallel
):
    (masks0, after0), (masks1, after1) = ranks2.run(check_masks, sequence_parallel)
    assert len(masks0) == len(masks1) == 6  # per layer: attention, its output, the MLP's output
    for call, ((live, mask0), (_, mask1)) in enumerate(zip(masks0, masks1, strict=True)):
        assert 0.05 < (mask0 & live).sum() / live.sum() < 0.15  # p = 0.1 drops about a tenth
        attention = call % 3 == 0  # [batch, this rank's heads, query, key]
        if attention or sequence_parallel:
            assert not torch.equal(mask0, mask1), call  # sharded: masks of its own
        else:
            assert torch.equal(mask0, mask1), call  # replicated: the same mask
    assert torch.equal(after0, after1)
