"""The chunked head + loss equals the unchunked one at tp=1: losses, gradients within 1e-6 relative,
with a LoRA adapter on the head too; a head of another kind keeps its own forward.

The reference is what the recipe computed before: ``lm_head`` over the whole micro-batch, then
``cross_entropy_sum``. Chunks are small here so that every case spans several, some of them all
``-100``.
"""

import pytest
import torch
import torch.nn.functional as F

from components.distributed.chunked_loss import (
    chunked_cross_entropy_sum,
    chunks_head,
    head_weights,
)
from components.distributed.tp_plan import cross_entropy_sum
from components.models import build_causal_lm
from components.models.lora import LoraOptions, apply_lora, lora_modules
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.tiny_models import tiny_config

TOLERANCE = 1e-6


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def batch(
    vocab: int, rows: int = 2, seq: int = 40, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))
    labels = tokens.clone()
    labels[:, :3] = -100  # a prompt
    labels[0, 10:30] = -100  # with chunk 8: whole chunks of row 0 without a label
    labels[1, -5:] = -100  # padding
    return tokens, labels


def head_and_loss(chunk: int | None, hidden, weight, labels) -> tuple[torch.Tensor, ...]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if chunk:
        loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk)
    else:
        loss = cross_entropy_sum(F.linear(hidden, weight), labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_function_matches_unchunked(chunk):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 40, 16, generator=generator)
    weight = torch.randn(96, 16, generator=generator)
    _, labels = batch(96)
    expected = head_and_loss(None, hidden, weight, labels)
    for got, want in zip(head_and_loss(chunk, hidden, weight, labels), expected, strict=True):
        assert relative(got, want) <= TOLERANCE


def test_all_labels_ignored_gives_zero_loss_and_gradients():
    hidden, weight = torch.randn(1, 12, 8), torch.randn(32, 8)
    loss, grad_hidden, grad_weight = head_and_loss(4, hidden, weight, torch.full((1, 12), -100))
    assert loss.item() == 0.0 and not grad_hidden.any() and not grad_weight.any()


def model_step(config, chunk: int | None, compute=None) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_causal_lm(config, seed=0)
    tokens, labels = batch(config.vocab_size)
    loss = forward_backward(
        model, tokens, labels, 50, compute=compute, aux_loss_weight=0.5, loss_chunk_tokens=chunk
    )
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss, grads


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen3", {}),
        ("qwen3_moe", {"output_router_logits": True}),
        ("mixtral", {"output_router_logits": True}),
    ],
)
def test_model_step_matches_unchunked(family, overrides):
    config = tiny_config(family, **overrides)
    loss, grads = model_step(config, 8)
    reference_loss, reference = model_step(config, None)
    assert abs(loss - reference_loss) <= TOLERANCE * abs(reference_loss)
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        assert relative(grad, reference[name]) <= TOLERANCE, name
    if overrides.get("tie_word_embeddings"):  # one parameter: gradients of embedding and head
        model = build_causal_lm(config, seed=0)
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_bf16_autocast_matches_unchunked():
    """Under autocast the head runs in bf16 on both paths and the softmax in fp32: the same loss up
    to summation order; gradients differ by bf16 rounding of per-chunk products only."""
    config = tiny_config("llama")

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    loss, grads = model_step(config, 8, autocast())
    reference_loss, reference = model_step(config, None, autocast())
    assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss)
    for name, grad in grads.items():
        assert relative(grad, reference[name]) <= 2e-2, name


def test_evaluation_matches_unchunked():
    model = build_causal_lm(tiny_config("qwen3"), seed=0)
    tokens, labels = batch(model.config.vocab_size)
    chunked = evaluate_loss_sum(model, tokens, labels, loss_chunk_tokens=8)
    unchunked = evaluate_loss_sum(model, tokens, labels, loss_chunk_tokens=0)
    assert abs(chunked - unchunked) <= TOLERANCE * chunked


def with_trained_adapters(model, options: LoraOptions) -> None:
    """``options``' adapters on ``model`` (seed 0), their B drawn non-zero as after training, so
    the update takes part in the logits."""
    apply_lora(model, options, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.normal_(std=0.05, generator=generator)


def lora_step(chunk: int | None, targets: tuple[str, ...], dropout: float, head=None):
    """One micro-batch of a tiny Llama with adapters on ``targets`` (their B drawn non-zero, as
    after training, so the update takes part in the logits), its loss and adapter gradients."""
    model = build_causal_lm(tiny_config("llama"), seed=0)
    options = LoraOptions(rank=4, alpha=8.0, dropout=dropout, target_modules=targets)
    with_trained_adapters(model, options)
    if head is not None:
        model.lm_head = head(model.lm_head)
    tokens, labels = batch(model.config.vocab_size)
    torch.manual_seed(5)  # the same dropout masks on both paths
    loss = forward_backward(model, tokens, labels, 50, loss_chunk_tokens=chunk)
    return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", [("lm_head",), ("lm_head", "*.q_proj")])
def test_an_adapted_head_takes_part_in_the_chunked_loss(targets, dropout):
    """LoRA on ``lm_head``: the chunked loss adds the adapter's scaled B·A·dropout(x) to each
    chunk's logits, so loss and gradients (the head's adapter's too) equal its own forward's; the
    dropout masks too, drawn once where the head's forward draws them."""
    loss, grads = lora_step(8, targets, dropout)
    reference_loss, reference = lora_step(None, targets, dropout)
    assert abs(loss - reference_loss) <= TOLERANCE * abs(reference_loss)
    assert grads.keys() == reference.keys()
    assert {"lm_head.lora_A.weight", "lm_head.lora_B.weight"} <= grads.keys()
    assert all(".lora_" in name for name in grads)  # the frozen head weight takes no gradient
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        assert relative(grad, reference[name]) <= TOLERANCE, name


class _ScaledHead(torch.nn.Linear):
    """A head another conversion wrapped (as torchao's Float8Linear subclasses nn.Linear): its
    forward is not a plain projection, and the chunked loss knows nothing of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def scaled(head: torch.nn.Linear) -> torch.nn.Linear:
    head.__class__ = _ScaledHead
    return head


def test_a_head_of_another_kind_runs_its_own_forward_unchunked():
    model = build_causal_lm(tiny_config("llama"), seed=0)
    assert head_weights(model.lm_head) is not None and chunks_head(model)
    model.lm_head = scaled(model.lm_head)
    assert head_weights(model.lm_head) is None and not chunks_head(model)
    loss, _ = lora_step(8, ("*.q_proj",), 0.0, scaled)
    assert loss == lora_step(None, ("*.q_proj",), 0.0, scaled)[0]
    assert loss != lora_step(8, ("*.q_proj",), 0.0)[0]  # the doubled logits did count
