"""DPO's micro-batch (``dpo_forward_backward``) on the recipe's own data path equals TRL 1.16's
``DPOTrainer`` on the same tiny Llama, records, batch and SGD: the same token rows and labels,
the first step's loss within 1e-6 relative and five steps' within 1e-5, for ``sigmoid`` and
``ipo``, with a frozen reference (the policy's starting weights); with ``dpo.reference_path``'s
reference (a Hugging Face folder of other weights, built frozen as the recipe builds it) against
TRL given that folder's model as ``ref_model``; and with ``peft=lora``'s adapters against TRL on a
PEFT model, whose reference is the model with its adapters off."""

import math
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from components.data.collate import tokenize_example
from components.data.loader import collate_rows
from components.data.preference import pair_conversations
from components.distributed.layout import ParallelDims
from components.models import build_causal_lm
from components.models.frozen import build_frozen_model
from components.models.load import load_config
from components.models.lora import LoraOptions, adapters_off, apply_lora, lora_modules
from components.training.preference import (
    DPO_METRICS,
    DpoOptions,
    DpoStep,
    answer_log_probs,
    dpo_forward_backward,
)
from recipes.tiny_models import tiny_config
from tests.harness import spec_for
from tests.unit.training.test_chunked_loss import relative
from tests.unit.training.test_post_training_losses import PREFERENCES, trl_trainer

STEPS, BETA = 5, 0.3
LR = {"sigmoid": 0.5, "ipo": 0.01}  # ipo's squared loss diverges at sigmoid's rate
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=None)


def llama(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama ``trl_trainer`` builds (its weights by ``seed``), built again here: TRL
    patches the forward of the models it is given."""
    return build_causal_lm(tiny_config("llama", vocab_size=300), seed=seed)


def our_batch(tokenizer, width: int):
    """The records as the recipe makes them: two conversations each, tokenized as SFT does, the
    chosen rows then the rejected ones (``PairBatches``' layout)."""
    made = [
        tokenize_example({"messages": messages}, tokenizer, 64, "all_assistant")
        for messages in zip(*map(pair_conversations, PREFERENCES), strict=True)
        for messages in messages
    ]
    return collate_rows([[one] for one in made], width, tokenizer.pad_token_id)


def trl_losses(trainer, batch, lr: float) -> list[float]:
    """TRL's own ``compute_loss`` on its batch, then a plain SGD step, :data:`STEPS` times."""
    model = trainer.model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def our_losses(policy, reference, batch, loss_type: str) -> list[list[float]]:
    """The recipe's DPO micro-batch on ``batch`` (its two pairs the whole step), then a plain SGD
    step, :data:`STEPS` times: each step's metric sums over its pairs, divided by them."""
    optimizer = torch.optim.SGD(
        [p for p in policy.parameters() if p.requires_grad], lr=LR[loss_type]
    )
    options = DpoOptions(beta=BETA, loss_type=loss_type)
    step = DpoStep(options=options, compute=nullcontext, chunk_tokens=3, reference=reference)
    sums = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        sums.append((dpo_forward_backward(policy, batch, 2, step) / 2).tolist())
        optimizer.step()
    return sums


def check(trl: list[float], ours: list[list[float]]) -> None:
    loss = [row[DPO_METRICS.index("loss")] for row in ours]
    assert relative(torch.tensor(loss[0]), torch.tensor(trl[0])) <= 1e-6
    assert max(abs(a - b) for a, b in zip(loss, trl, strict=True)) <= 1e-5
    assert loss[-1] < loss[0] - 1e-3  # it trains: the check can fail


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_steps_equal_trl_dpo_trainer(tmp_path, loss_type):
    trainer, trl_batch = trl_trainer(tmp_path, loss_type, beta=BETA, reference_seed=0)
    policy, reference = llama(), llama()
    batch = our_batch(trainer.processing_class, trl_batch["input_ids"].shape[1])
    assert torch.equal(batch.input_ids, trl_batch["input_ids"])
    trl_labels = trl_batch["input_ids"].masked_fill(trl_batch["completion_mask"] == 0, -100)
    assert torch.equal(batch.labels, trl_labels)
    reference.requires_grad_(False)
    trl = trl_losses(trainer, trl_batch, LR[loss_type])
    check(trl, our_losses(policy, reference, batch, loss_type))


@pytest.fixture
def world_of_one():
    """A gloo world of one rank (tp=1), for the recipe's meshes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ParallelDims()
    dist.destroy_process_group()


def test_a_reference_folder_equals_trl_given_it_as_ref_model(tmp_path, world_of_one):
    """``dpo.reference_path``: a folder of the policy's shape and other weights (seed 1), built
    frozen by the recipe's ``build_frozen_model`` (meta device, then loaded), against TRL's
    ``DPOTrainer(ref_model=...)`` on the same folder loaded by transformers."""
    folder = tmp_path / "reference"
    llama(seed=1).save_pretrained(folder)
    ref_model = AutoModelForCausalLM.from_pretrained(folder)
    trainer, trl_batch = trl_trainer(tmp_path, "sigmoid", beta=BETA, ref_model=ref_model)
    assert trainer.ref_model is ref_model
    spec = spec_for(load_config(folder), weights=folder)
    meshes = world_of_one.build_meshes("cpu")
    reference = build_frozen_model(spec, world_of_one, meshes, torch.device("cpu"))
    batch = our_batch(trainer.processing_class, trl_batch["input_ids"].shape[1])
    trl = trl_losses(trainer, trl_batch, LR["sigmoid"])
    ours = our_losses(llama(), reference, batch, "sigmoid")
    check(trl, ours)
    assert abs(ours[0][DPO_METRICS.index("loss")] - math.log(2)) > 1e-3  # not the policy's start


def test_lora_dpo_equals_trl_on_a_peft_model_with_its_adapters_off(tmp_path):
    from peft import LoraConfig

    policy = llama()
    apply_lora(policy, LORA, seed=0)
    torch.manual_seed(0)
    for _, layer in lora_modules(policy):  # B non-zero: the first step's reference differs
        torch.nn.init.normal_(layer.lora_B.weight, std=0.05)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS)
    trainer, trl_batch = trl_trainer(tmp_path, "sigmoid", beta=BETA, peft_config=peft_config)
    assert trainer.ref_model is None  # TRL's reference: the PEFT model with its adapters off
    adapters = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if parameter.requires_grad:
                ours = name.removeprefix("base_model.model.").replace(".default", "")
                parameter.copy_(adapters.pop(ours))
    assert not adapters  # every adapter has its PEFT twin
    batch = our_batch(trainer.processing_class, trl_batch["input_ids"].shape[1])
    trl = trl_losses(trainer, trl_batch, LR["sigmoid"])
    check(trl, our_losses(policy, None, batch, "sigmoid"))


def test_adapters_off_is_the_base_model_head_included(tmp_path):
    """TRL refuses an adapter on ``lm_head``; ours has one: switched off, the chunked head
    computes the base weight's log-probabilities, the base model's exactly."""
    trainer, _ = trl_trainer(tmp_path, "sigmoid")
    batch = our_batch(trainer.processing_class, 24)
    adapted = llama()
    options = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=("lm_head", "*_proj"))
    apply_lora(adapted, options, seed=0)
    for _, layer in lora_modules(adapted):
        torch.nn.init.normal_(layer.lora_B.weight, std=0.05)
    with torch.no_grad():
        base = answer_log_probs(llama(), batch, 3)
        adapted_on = answer_log_probs(adapted, batch, 3)
        with adapters_off(adapted):
            adapted_off = answer_log_probs(adapted, batch, 3)
    assert torch.equal(adapted_off, base) and not torch.allclose(adapted_on, base)
