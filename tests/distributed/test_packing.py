"""Packed rows under tensor parallelism (with and without sequence parallelism) give every example
its single-process unpacked loss and the same gradients; and ranks forked after the data is prepared
run. (The harness's ranks use one thread each: a forked rank must never start OpenMP threads after
its parent used them, whatever the data path does; that rule is the launcher's, tested with the
recipe.)

Data comes through the launcher's path: ``prepare_data`` writes the Arrow cache, the ranks open it
with ``StepBatches.open``. fp32; tolerance 1e-5 relative on losses and gradients (measured ~1e-7).
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from components.data.loader import Batch, StepBatches
from components.data.prepare import prepare_data, source_cache_dir
from components.data.sources import GeneratedSource
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.tp_plan import apply_tp_plan
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models import build_causal_lm
from components.models.families import plan_for
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import RankPool, mesh

SEQ_LEN = 64
ROWS = 4  # packed rows of one step, per rank (the same on both TP ranks)
SOURCE = GeneratedSource(num_examples=200, val_fraction=0.0, seed=0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(SOURCE.texts(source_cache_dir(root)), DEFAULT_VOCAB_SIZE, tokenizer_dir)
    common = dict(seq_len=SEQ_LEN, loss_on="all_assistant", seed=0, cache_root=root, num_proc=1)
    packed = prepare_data(SOURCE, tokenizer_dir, packing=True, **common)
    unpacked = prepare_data(SOURCE, tokenizer_dir, packing=False, **common)
    return packed, unpacked, len(AutoTokenizer.from_pretrained(tokenizer_dir))


def _spans(batch: Batch) -> list[tuple[int, int, int]]:
    spans = []
    for row, positions in enumerate(batch.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0]
        for start, end in zip(starts, [*starts[1:], SEQ_LEN], strict=True):
            if (batch.labels[row, start:end] != -100).any():
                spans.append((row, start, end))
    return spans


def _per_example(model, batch: Batch) -> list[float]:
    """Each example's loss sum: the batch evaluated with every other example's labels masked."""
    losses = []
    for row, start, end in _spans(batch):
        labels = torch.full_like(batch.labels, -100)
        labels[row, start:end] = batch.labels[row, start:end]
        losses.append(evaluate_loss_sum(model, batch.input_ids, labels, batch.position_ids))
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_packed_tp(rank, world_size, packed, unpacked, vocab_size, sequence_parallel):
    config = tiny_config("llama", vocab_size=vocab_size)
    data = StepBatches.open(packed.train, ROWS, ROWS, dp_size=1, dp_rank=0, seed=0)
    (batch,) = data.batches_for_step(0)
    examples = sum(int((batch.position_ids == 0).sum(1)[r]) for r in range(ROWS))
    assert examples > 2 * ROWS  # rows really hold several examples
    reference = build_causal_lm(config, seed=0)
    # The same examples unpacked, one per row, in the same order as they lie in the packed rows.
    plain = StepBatches.open(unpacked.train, 1, 1, dp_size=1, dp_rank=0, seed=0)
    order = [
        int(i)
        for r in data.indices_for_step(0)
        for i in data.rows.order[data.rows.offsets[r] : data.rows.offsets[r + 1]]
    ]
    one_each = plain._batches(order)  # rows of the unpacked split are the examples themselves
    expected = [loss for single in one_each for loss in _per_example(reference, single)]
    for single in one_each:
        forward_backward(
            reference, single.input_ids, single.labels, data.labels_in_step(0), single.position_ids
        )

    model = build_causal_lm(config, seed=0)
    apply_tp_plan(
        model,
        mesh((1, world_size), ("dp", "tp"))["tp"],
        plan_for(config, sequence_parallel),
        config,
        sequence_parallel,
    )
    device_mesh = mesh((1, world_size), ("dp", "tp"))
    broadcast_tp_replicas([model], device_mesh)
    losses = _per_example(model, batch)
    forward_backward(
        model, batch.input_ids, batch.labels, data.labels_in_step(0), batch.position_ids
    )
    finalize_dtensor_gradients([model])
    synchronize_tp_replica_gradients([model], device_mesh)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    named = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            _full(parameter.grad), named[name].grad, rtol=1e-5, atol=1e-7, msg=name
        )
    return len(losses)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_packed_rows_at_tp2_match_unpacked_single_process(ranks2, prepared, sequence_parallel):
    counts = ranks2.run(check_packed_tp, *prepared, sequence_parallel)
    assert counts[0] == counts[1] > 2 * ROWS


def check_forked_rank_reads_and_computes(rank, world_size, split):
    data = StepBatches.open(split, 8, 4, dp_size=world_size, dp_rank=rank, seed=0)
    (batch,) = data.batches_for_step(3)
    product = (torch.randn(256, 256) @ torch.randn(256, 256)).sum()
    total = torch.tensor([float(batch.labelled_tokens())])
    dist.all_reduce(total)
    assert total.item() == data.labels_in_step(3) and torch.isfinite(product)
    return int(batch.input_ids.sum())


def test_ranks_forked_after_preparing_data_with_worker_processes_do_not_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "components.data.prepare.RECORDS_PER_PROCESS", 50
    )  # so map really starts 2 workers
    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer(SOURCE.texts(source_cache_dir(tmp_path)), DEFAULT_VOCAB_SIZE, tokenizer_dir)
    prepared = prepare_data(
        SOURCE,
        tokenizer_dir,
        seq_len=SEQ_LEN,
        loss_on="all_assistant",
        packing=True,
        seed=0,
        cache_root=tmp_path,
        num_proc=2,
    )
    assert (
        os.environ["TOKENIZERS_PARALLELISM"] == "false"
    )  # no Rust thread pool for a forked rank to inherit
    pool = RankPool(
        2, timeout_s=60
    )  # forked now, after the tokenizer, datasets and map workers have run
    try:
        sums = pool.run(check_forked_rank_reads_and_computes, prepared.train)
    finally:
        pool.close()
    assert len(set(sums)) == 2  # two dp ranks read different rows
