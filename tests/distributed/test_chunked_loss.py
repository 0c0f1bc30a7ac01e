"""The chunked head + loss at tp=2 (gloo): vocab-parallel, equal to the unchunked loss within 1e-6.

Function level: the ``lm_head`` weight is a ``Shard(0)`` DTensor over the TP mesh (the
``vocab_parallel`` style), the hidden states replicated (plain TP) or sequence-sharded (sp); the
reference is the whole-vocab unchunked loss computed in one process. Model level: a tiny model
parallelised by its plan trains one micro-batch chunked and unchunked (``cross_entropy_sum`` under
``loss_parallel``), tied embeddings included, and with a LoRA adapter on the head.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from components.distributed.chunked_loss import chunked_cross_entropy_sum
from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.tp_plan import apply_tp_plan, cross_entropy_sum
from components.models import build_causal_lm
from components.models.families import plan_for
from components.models.lora import LoraOptions
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config
from tests.harness import mesh
from tests.unit.training.test_chunked_loss import (
    TOLERANCE,
    batch,
    relative,
    with_trained_adapters,
)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_function(rank, world_size, sequence_parallel, chunk):
    tp_mesh = mesh((world_size,), ("tp",))
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 40, 16, generator=generator)
    weight = torch.randn(96, 16, generator=generator)
    _, labels = batch(96)
    reference_hidden = hidden.clone().requires_grad_()
    reference_weight = weight.clone().requires_grad_()
    reference = cross_entropy_sum(F.linear(reference_hidden, reference_weight), labels)
    reference.backward()

    sharded_weight = distribute_tensor(weight, tp_mesh, [Shard(0)]).requires_grad_()
    # sp: each rank holds a slice of the sequence (its gradient arrives reduce-scattered onto it)
    inputs = distribute_tensor(hidden, tp_mesh, [Shard(1)]) if sequence_parallel else hidden.clone()
    inputs.requires_grad_()
    loss = chunked_cross_entropy_sum(inputs, sharded_weight, labels, chunk)
    loss.backward()
    return {
        "loss": relative(loss.detach(), reference.detach()),
        "hidden": relative(full(inputs.grad), reference_hidden.grad),
        "weight": relative(full(sharded_weight.grad), reference_weight.grad),
        "weight_local_rows": sharded_weight.grad.to_local().shape[0],
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("chunk", [8, 1000])
def test_vocab_parallel_function_matches_unchunked(ranks2, sequence_parallel, chunk):
    for errors in ranks2.run(check_function, sequence_parallel, chunk):
        assert errors.pop("weight_local_rows") == 48  # each rank computed its vocabulary shard only
        assert max(errors.values()) <= TOLERANCE, errors


def check_model(rank, world_size, family, overrides, sequence_parallel, lora=None):
    tp_mesh = mesh((world_size,), ("tp",))
    config = tiny_config(family, **overrides)
    tokens, labels = batch(config.vocab_size, seq=48)
    results = []
    for chunk in (8, None):
        model = build_causal_lm(config, seed=0)
        if lora is not None:  # adapters, their B non-zero as after training
            with_trained_adapters(model, lora)
        plan = plan_for(config, sequence_parallel)
        apply_tp_plan(model, tp_mesh, plan, config, sequence_parallel)
        loss = forward_backward(
            model, tokens, labels, 50, aux_loss_weight=0.5, loss_chunk_tokens=chunk
        )
        finalize_dtensor_gradients([model])
        grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        results.append((loss, grads, tied))
    (loss, grads, tied), (reference_loss, reference, reference_tied) = results
    assert tied == reference_tied == bool(overrides.get("tie_word_embeddings"))
    assert grads.keys() == reference.keys()
    errors = {name: relative(grad, reference[name]) for name, grad in grads.items()}
    worst = max(errors, key=errors.get)
    if lora is not None:  # the head's adapter trains, its B split over the vocabulary
        assert {"lm_head.lora_A.weight", "lm_head.lora_B.weight"} <= grads.keys()
        assert all(".lora_" in name for name in grads)
        assert model.lm_head.lora_B.weight.placements == model.lm_head.weight.placements
    return abs(loss - reference_loss) / abs(reference_loss), errors[worst], worst


@pytest.mark.parametrize(
    "family, overrides, sequence_parallel",
    [
        ("llama", {}, False),
        ("llama", {"tie_word_embeddings": True}, False),
        ("llama", {"tie_word_embeddings": True}, True),
        ("qwen3", {}, True),
        ("qwen3_moe", {"output_router_logits": True}, False),
    ],
)
def test_parallel_model_matches_unchunked(ranks2, family, overrides, sequence_parallel):
    for loss_error, grad_error, worst in ranks2.run(
        check_model, family, overrides, sequence_parallel
    ):
        assert loss_error <= TOLERANCE and grad_error <= TOLERANCE, (loss_error, grad_error, worst)


HEAD_LORA = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=("lm_head", "*.q_proj"))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_an_adapted_vocab_parallel_head_matches_unchunked(ranks2, sequence_parallel):
    """LoRA on the vocab-parallel lm_head: B split by vocabulary rows as the head's weight, the
    chunked loss adds its update per chunk; loss and every adapter's gradient equal the head's own
    forward's under loss_parallel."""
    for loss_error, grad_error, worst in ranks2.run(
        check_model, "llama", {}, sequence_parallel, HEAD_LORA
    ):
        assert loss_error <= TOLERANCE and grad_error <= TOLERANCE, (loss_error, grad_error, worst)
