"""LoRA (components/models/lora.py) against the peft library, the reference: the same tiny model,
batches and optimizer give the same run, with per-expert adapters on an MoE model's experts too
(peft's ``target_parameters``), whose export ``PeftModel`` loads to our logits; the base stays
frozen; targets are checked."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict

from components.checkpoint.peft_export import adapter_config, export_peft_adapter
from components.models import build_causal_lm
from components.models.lora import (
    LoraOptions,
    adapted_parameters,
    adapter_state,
    apply_lora,
    lora_modules,
    targeted_linears,
)
from recipes.tiny_models import tiny_config

PEFT_CONF = OmegaConf.load("conf/peft/lora.yaml")
OPTIONS = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=PEFT_CONF.target_modules)


EXPERTS = dataclasses.replace(OPTIONS, experts=("model.layers.*.mlp.experts",))


def _twins(family: str = "llama") -> tuple[torch.nn.Module, torch.nn.Module]:
    """Our LoRA model and peft's on the same base weights, with our adapters' initial values
    (on qwen3_moe, per-expert adapters too: peft's ``target_parameters``)."""
    config = tiny_config(family, vocab_size=96)
    ours = build_causal_lm(config, seed=0)
    options = EXPERTS if family == "qwen3_moe" else OPTIONS
    names = apply_lora(ours, options, seed=0)
    lora = dict(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=names)
    parameters = adapted_parameters(ours)
    reference = get_peft_model(
        build_causal_lm(config, seed=0), LoraConfig(**lora, target_parameters=parameters or None)
    )
    loaded = set_peft_model_state_dict(reference, adapter_state(ours, torch.float32))
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    return ours, reference


def _peft_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our adapters in peft's saved layout and names, or peft's own."""
    if isinstance(model, PeftModel):
        return get_peft_model_state_dict(model)
    return adapter_state(model, torch.float32)


def adapter_losses(model: torch.nn.Module, optimizer_class, options: dict) -> list[float]:
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


ADAMW = (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01))
SGD = (torch.optim.SGD, dict(lr=0.5))
RUNS = {"adamw": ("llama", *ADAMW), "sgd": ("llama", *SGD)}
RUNS |= {"experts-adamw": ("qwen3_moe", *ADAMW), "experts-sgd": ("qwen3_moe", *SGD)}


@dataclasses.dataclass(kw_only=True)
class Run:
    """Our LoRA model and peft's after the same five steps, with their losses, and our base's
    weights before them."""

    ours: torch.nn.Module
    reference: torch.nn.Module
    ours_losses: list[float]
    reference_losses: list[float]
    base: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """Each of :data:`RUNS` trained once, on first use: the parity cases, the export and the frozen
    base read the same runs."""
    return {}


def trained(runs: dict[str, Run], name: str) -> Run:
    if name not in runs:
        family, optimizer_class, options = RUNS[name]
        ours, reference = _twins(family)
        base = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
        runs[name] = Run(
            ours=ours,
            reference=reference,
            ours_losses=adapter_losses(ours, optimizer_class, options),
            reference_losses=adapter_losses(reference, optimizer_class, options),
            base=base,
        )
    return runs[name]


@pytest.mark.parametrize("name", list(RUNS))
def test_five_steps_equal_peft_lora_on_the_same_model_batches_and_optimizer(runs, name):
    run = trained(runs, name)
    ours, reference, ours_losses = run.ours, run.reference, run.ours_losses
    family, optimizer_class, _ = RUNS[name]
    assert ours_losses == pytest.approx(run.reference_losses, rel=1e-5)
    assert ours_losses[-1] < ours_losses[0]  # it trains
    theirs = _peft_adapters(reference)
    # peft forms each expert's W + s·B·A before multiplying, we add s·(x·Aᵀ)·Bᵀ: other roundings.
    # AdamW's step m/(sqrt(v)+eps) magnifies them where gradients are near eps (experts few tokens
    # reach): the losses agree to 1e-5, the weights to ~2e-5 (SGD's to 1e-7)
    experts_adamw = family == "qwen3_moe" and optimizer_class is torch.optim.AdamW
    atol = 5e-5 if experts_adamw else 1e-7
    for key, ours_w in _peft_adapters(ours).items():
        assert ours_w.abs().sum() > 0, key  # every adapter trained, the experts' B too
        torch.testing.assert_close(ours_w, theirs[key], rtol=1e-5, atol=atol)


def test_our_exported_expert_adapters_loaded_by_peft_give_our_logits(runs, tmp_path):
    ours = trained(runs, "experts-adamw").ours
    names = [name for name, _ in lora_modules(ours)]
    config = adapter_config(4, 8.0, 0.0, names, None, adapted_parameters(ours))
    export_peft_adapter(adapter_state(ours, torch.float32), config, tmp_path / "adapter")
    base = build_causal_lm(tiny_config("qwen3_moe", vocab_size=96), seed=0)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, logits = ours(input_ids=ids).logits, loaded(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_the_base_is_frozen_and_only_adapters_train(runs):
    run = trained(runs, "adamw")  # five steps of AdamW, weight decay among them
    names = sorted(n for n, p in run.ours.named_parameters() if p.requires_grad)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 7 * 2  # A and B on 7 projections in each of 2 layers
    assert run.base  # the frozen weights, as they were before the steps
    for name, parameter in run.ours.named_parameters():
        if name in run.base:
            assert torch.equal(parameter, run.base[name]), name
            assert parameter.grad is None, name


def test_targets_that_are_not_linear_or_match_nothing_are_refused():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    assert targeted_linears(model, ("*.q_proj",))[1] == []
    assert "not a linear layer" in targeted_linears(model, ("*.self_attn",))[1][0]
    names, problems = targeted_linears(model, ("*.q_proj", "*.nothing"))  # a typo among matches
    assert names == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    assert problems == [
        "peft.target_modules pattern '*.nothing' matches no module of LlamaForCausalLM: fix or "
        "remove it (module names such as 'model.layers.0.self_attn.q_proj', 'lm_head')"
    ]


def test_null_targets_are_the_projections_the_model_has():
    """The attention and MLP projections where the model has them: on an MoE model the attention
    alone (its sparse MLPs have no gate_proj), with no problem for the patterns it lacks."""
    dense = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    moe = build_causal_lm(tiny_config("qwen3_moe", vocab_size=96), seed=0)
    assert targeted_linears(dense, None) == (sorted_linears(dense, "_proj"), [])
    assert targeted_linears(moe, None) == (sorted_linears(moe, "self_attn."), [])
    (problem,) = targeted_linears(moe, ("*.mlp.gate_proj",))[1]  # given, it must match
    assert problem.startswith("peft.target_modules pattern '*.mlp.gate_proj' matches no module")


def sorted_linears(model: torch.nn.Module, part: str) -> list[str]:
    linears = (n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    return [name for name in linears if part in name and "experts" not in name]
