"""LoRA (components/models/lora.py) against the peft library, the reference: the same tiny model,
batches and optimizer give the same run; the base stays frozen; targets are checked."""

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model

from components.models import build_causal_lm, tiny_config
from components.models.lora import LoraOptions, apply_lora, lora_modules, targeted_linears

PEFT_CONF = OmegaConf.load("conf/peft/lora.yaml")
OPTIONS = LoraOptions(
    rank=4, alpha=8.0, dropout=0.0, target_modules=tuple(PEFT_CONF.target_modules)
)


def _twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Our LoRA model and peft's on the same base weights, with our adapters' initial values."""
    config = tiny_config("llama", vocab_size=96)
    ours = build_causal_lm(config, seed=0)
    names = apply_lora(ours, OPTIONS, seed=0)
    reference = get_peft_model(
        build_causal_lm(config, seed=0),
        LoraConfig(
            r=OPTIONS.rank, lora_alpha=OPTIONS.alpha, lora_dropout=0.0, target_modules=names
        ),
    )
    with torch.no_grad():
        for name, module in lora_modules(ours):
            theirs = reference.base_model.model.get_submodule(name)
            theirs.lora_A["default"].weight.copy_(module.lora_A.weight)
            theirs.lora_B["default"].weight.copy_(module.lora_B.weight)
    return ours, reference


def _losses(model: torch.nn.Module, optimizer_class, options: dict) -> list[float]:
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_class(trained, **options)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):  # one batch again and again: the loss must fall
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "optimizer_class, options",
    [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)), (torch.optim.SGD, dict(lr=0.5))],
    ids=["adamw", "sgd"],
)
def test_five_steps_equal_peft_lora_on_the_same_model_batches_and_optimizer(
    optimizer_class, options
):
    ours, reference = _twins()
    ours_losses = _losses(ours, optimizer_class, options)
    reference_losses = _losses(reference, optimizer_class, options)
    assert ours_losses == pytest.approx(reference_losses, rel=1e-5)
    assert ours_losses[-1] < ours_losses[0]  # it trains
    for name, module in lora_modules(ours):
        theirs = reference.base_model.model.get_submodule(name)
        for ours_w, their_w in (
            (module.lora_A.weight, theirs.lora_A["default"].weight),
            (module.lora_B.weight, theirs.lora_B["default"].weight),
        ):
            torch.testing.assert_close(ours_w, their_w, rtol=1e-5, atol=1e-7)


def test_the_base_is_frozen_and_only_adapters_train():
    ours, _ = _twins()
    base = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    trained = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * 2  # A and B on 7 projections in each of 2 layers
    _losses(ours, torch.optim.AdamW, dict(lr=1e-2))
    for name, parameter in ours.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name
            assert parameter.grad is None, name


def test_targets_that_are_not_linear_or_match_nothing_are_refused():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    assert targeted_linears(model, ("*.q_proj",))[1] == []
    assert "not a linear layer" in targeted_linears(model, ("*.self_attn",))[1][0]
    assert "match no linear layer" in targeted_linears(model, ("*.nothing",))[1][0]
