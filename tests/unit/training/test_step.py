"""forward_backward / evaluate_loss_sum on packed rows: the same per-example loss and the same
update as unpacked.

A tiny Llama sees the same examples twice: one per row (padded), and packed several per row with
position ids restarting at each example. Hugging Face then keeps attention inside each example, so
every example's loss, the gradients and one SGD or AdamW step agree to float rounding (tolerance
1e-5 relative).
"""

import copy
import functools

import pytest
import torch

from components.data.collate import Labelling
from components.data.generated import generate_examples
from components.data.loader import Batch, StepBatches
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts
from components.models import build_causal_lm
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.tiny_models import tiny_config

SEQ_LEN = 64
RECORDS = generate_examples(16, seed=3)
RTOL = 1e-5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(
        training_texts(RECORDS), DEFAULT_VOCAB_SIZE, tmp_path_factory.mktemp("tokenizer")
    )


@functools.cache
def loader(tokenizer, packing: bool) -> StepBatches:
    rows = len(
        RECORDS
    )  # every example in one micro-batch either way: the packed loader has fewer rows
    kwargs = dict(
        labelling=Labelling(tokenizer=tokenizer, seq_len=SEQ_LEN, loss_on="all_assistant"),
        dp_size=1,
        dp_rank=0,
        seed=0,
        packing=packing,
    )
    unpacked = StepBatches.from_records(RECORDS, rows, rows, **{**kwargs, "packing": False})
    if not packing:
        return unpacked
    packed = StepBatches.from_records(RECORDS, 1, 1, **kwargs)
    return StepBatches.from_records(RECORDS, packed.num_rows, packed.num_rows, **kwargs)


def whole_split(batches: StepBatches) -> Batch:
    (batch,) = batches._batches(
        list(range(batches.num_rows))
    )  # every row, in order: examples in record order
    return batch


def example_spans(batch: Batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of every example in row-major order: an example starts where positions
    restart."""
    spans = []
    for row, positions in enumerate(batch.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0]
        ends = [*starts[1:], len(positions)]
        spans += [
            (row, s, e)
            for s, e in zip(starts, ends, strict=True)
            if (batch.labels[row, s:e] != -100).any()
        ]
    return spans


@torch.no_grad()
def per_example_loss(
    model, batch: Batch, spans: list[tuple[int, int, int]] | None = None
) -> list[float]:
    """Each example's summed next-token loss (its span's shifted labels), from one forward of the
    batch."""
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
    ).logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch.labels[:, 1:], ignore_index=-100, reduction="none"
    )
    return [
        losses[row, start : end - 1].sum().item()
        for row, start, end in spans or example_spans(batch)
    ]


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_causal_lm(tiny_config("llama", vocab_size=len(tokenizer)), seed=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_each_example_its_unpacked_loss(model, tokenizer, attention):
    model = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    unpacked, packed = whole_split(loader(tokenizer, False)), whole_split(loader(tokenizer, True))
    assert (
        packed.input_ids.shape[0] < unpacked.input_ids.shape[0] / 3
    )  # really packed: > 3 examples per row
    expected = per_example_loss(model, unpacked)
    assert len(expected) == len(RECORDS)
    torch.testing.assert_close(per_example_loss(model, packed), expected, rtol=RTOL, atol=0)


def test_without_restarting_positions_examples_would_leak_into_each_other(model, tokenizer):
    packed = whole_split(loader(tokenizer, True))
    positions = torch.arange(SEQ_LEN).expand_as(packed.input_ids)
    plain = Batch(
        input_ids=packed.input_ids,
        labels=packed.labels,
        position_ids=positions,
        real_tokens=packed.real_tokens,
    )
    leaked = per_example_loss(model, plain, example_spans(packed))
    expected = per_example_loss(model, whole_split(loader(tokenizer, False)))
    assert leaked[0] == pytest.approx(
        expected[0], rel=RTOL
    )  # the first example of a row sees nothing before it
    assert max(abs(a - b) / b for a, b in zip(leaked, expected, strict=True)) > 100 * RTOL


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_step_on_packed_rows_updates_the_model_as_unpacked(model, tokenizer, optimizer):
    updated = {}
    for packing in (False, True):
        trained = copy.deepcopy(model)
        make = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        step = make(trained.parameters(), lr=0.05)
        data = loader(tokenizer, packing)
        batch = whole_split(data)
        assert data.labels_in_step(0) == batch.labelled_tokens()
        forward_backward(
            trained, batch.input_ids, batch.labels, data.labels_in_step(0), batch.position_ids
        )
        grads = [p.grad.clone() for p in trained.parameters()]
        step.step()
        updated[packing] = (grads, per_example_loss(trained, whole_split(loader(tokenizer, False))))
    for unpacked_grad, packed_grad in zip(updated[False][0], updated[True][0], strict=True):
        torch.testing.assert_close(packed_grad, unpacked_grad, rtol=RTOL, atol=1e-7)
    torch.testing.assert_close(updated[True][1], updated[False][1], rtol=RTOL, atol=0)


def test_default_position_ids_are_the_plain_range(model, tokenizer):
    batch = whole_split(loader(tokenizer, False))
    assert evaluate_loss_sum(model, batch.input_ids, batch.labels) == evaluate_loss_sum(
        model, batch.input_ids, batch.labels, batch.position_ids
    )
