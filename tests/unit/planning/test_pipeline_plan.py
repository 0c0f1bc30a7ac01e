"""The dry run's pipeline arithmetic: the micro-batches each pipeline rank holds at its peak under
torch's schedules, the bubble, and a stage's memory (its own layers' state and activations times
the micro-batches in flight, its output kept, the logits only on the last)."""

import pytest

from components.distributed.layout import ParallelDims
from components.distributed.pipeline import keep_stage, rank_share
from components.models.build import meta_causal_lm
from components.planning.memory_model import Layout, Stage, Step, estimate_memory
from components.planning.pipeline_schedule import bubble, grads_held, in_flight
from recipes.tiny_models import tiny_config


def test_micro_batches_in_flight_per_rank_and_schedule():
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]  # min(pp - s, m)
    assert [in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, s, 8) for s in range(4)] == [8] * 4
    # torch's interleaved warmup at pp=2, v=2, m=4: 2·1 + 2·(1 - s) forward chunks, then one more
    assert [in_flight("interleaved_1f1b", 2, s, 4, 2) for s in range(2)] == [2.5, 1.5]
    assert [grads_held("1f1b", 4, s, 8) for s in range(4)] == [True] * 4  # a steady state
    assert not grads_held("1f1b", 4, 0, 4) and not grads_held("gpipe", 4, 3, 8)


def test_the_bubble_is_the_formula():
    assert bubble("1f1b", 4, 8) == bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble("interleaved_1f1b", 2, 4, 2) == pytest.approx(1 / 9)


def test_a_stage_holds_its_layers_and_its_micro_batches_in_flight():
    config = tiny_config("llama", num_hidden_layers=4, vocab_size=512)
    sizes = dict(seq_len=64, global_batch_size=8, optimizer_moments=2, loss_chunk_tokens=0)
    fp32 = dict(precision="fp32", sequence_parallel=False, device_type="cpu", runtime_gib=0.0)
    step = Step(**sizes, **fp32)
    layout = Layout(dims=ParallelDims(pp=2), micro_batch_size=2, activation_checkpointing="none")
    whole = estimate_memory(meta_causal_lm(config), config, layout, step)
    layers, first, last = rank_share(0, 2, 1, 4)
    assert (layers, first, last) == ([0, 1], True, False)  # 3 of 6 units: the embedding is one
    model = keep_stage(meta_causal_lm(config), layers, first, last)
    stage = Stage(layers=(0, 1), last=False, pipelined=True)
    one = estimate_memory(model, config, layout, step, stage)
    three = estimate_memory(model, config, layout, step, Stage(**{**vars(stage), "in_flight": 3}))
    assert one.detail["layers"] == pytest.approx(whole.detail["layers"] / 2)
    assert three.detail["layers"] == pytest.approx(3 * one.detail["layers"])
    output = 2 * 64 * config.hidden_size * 4  # a micro-batch's hidden states, fp32
    assert one.detail["stage_output"] * 1024**3 == pytest.approx(output)
    assert one.detail["logits"] == 0 and whole.detail["logits"] > 0  # no head on stage 0
    embedding = config.vocab_size * config.hidden_size
    layer = sum(p.numel() for p in model.model.layers.parameters())
    assert one.params * 1024**3 == (embedding + layer) * 4
