"""The post-training losses' components at tp=1 against references on the whole logits, values
and gradients within 1e-6 relative, with a LoRA-adapted head too:

- answer-token log-probabilities (chunked) against TRL's own ``selective_log_softmax``;
- DPO (``sigmoid``, cDPO label smoothing, ``ipo``) on them against TRL 1.16's ``DPOTrainer``
  formulas (``_compute_loss``; TRL has no loss function of its own to call), written out here, and
  against a real ``DPOTrainer``'s ``compute_loss`` on a tiny Llama, loss and gradients;
- knowledge distillation's CE and KL(teacher ‖ student) at temperature T against
  ``F.cross_entropy`` and ``F.kl_div`` on the full-vocabulary log-softmaxes (KL within 1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from trl.trainer.utils import selective_log_softmax

from components.data.tokenizer import train_tokenizer
from components.distributed.chunked_distillation import (
    chunked_distillation_sums,
    distillation_loss,
)
from components.distributed.chunked_loss import (
    HeadAdapter,
    chunked_head,
    chunked_token_log_probs,
    lm_head_skipped,
)
from components.models import build_causal_lm
from components.training.preference import DpoOptions, PairLogProbs, dpo_losses
from recipes.tiny_models import tiny_config
from tests.unit.training.test_chunked_loss import TOLERANCE, batch, relative

VOCAB, HIDDEN, TEACHER_HIDDEN, RANK = 96, 16, 24, 4
# The KL term's gradient, (softmax(z/T) - softmax(t/T)) / T summed chunk by chunk into the head's
# gradient, is ~1e-6 from a float64 reference in fp32 (the whole-logits fp32 reference ~5e-7): the
# distillation parity bound of issue 46.
KD_TOLERANCE = 1e-5


def leaves(seed: int, *shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]


def whole_logits(hidden, weight, adapter: HeadAdapter | None) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    if adapter is None:
        return logits
    return logits + F.linear(F.linear(hidden, adapter.A), adapter.B) * adapter.scaling


def adapter_of(A, B) -> HeadAdapter:
    return HeadAdapter(A=A, B=B, scaling=2.0, dropout=nn.Identity())


def gradients(output: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(output, inputs, retain_graph=True))


def worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(relative(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("lora", [False, True])
def test_token_log_probs_match_trl_on_whole_logits(chunk, lora):
    hidden, weight, A, B = leaves(
        1, (2, 40, HIDDEN), (VOCAB, HIDDEN), (RANK, HIDDEN), (VOCAB, RANK)
    )
    inputs = [hidden, weight, A, B] if lora else [hidden, weight]
    adapter = adapter_of(A, B) if lora else None
    _, labels = batch(VOCAB)
    upstream = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))  # one per token
    got = chunked_token_log_probs(chunked_head(hidden, weight, adapter), labels, chunk)

    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    mask = targets != -100
    want = selective_log_softmax(
        whole_logits(hidden, weight, adapter), targets.clamp(min=0)
    ).masked_fill(~mask, 0.0)
    assert relative(got, want) <= TOLERANCE and not got[~mask].any()
    grads = gradients((got * upstream).sum(), inputs)
    assert worst(grads, gradients((want * upstream).sum(), inputs)) <= TOLERANCE


def trl_dpo_losses(policy, reference, tokens, beta, loss_type, label_smoothing):
    """TRL 1.16 ``DPOTrainer._compute_loss``'s per-sequence losses (``f_divergence_type``
    reverse_kl), from its source: sigmoid (with label smoothing, the cDPO form TRL's ``sigmoid``
    had before 1.0 and its ``aot`` keeps), ipo with TRL's per-token averaging."""
    chosen_logratios = policy[0] - reference[0]
    rejected_logratios = policy[1] - reference[1]
    delta_score = chosen_logratios - rejected_logratios
    if loss_type == "ipo":
        chosen_avg_score = chosen_logratios / tokens[0].clamp(min=1.0)
        rejected_avg_score = rejected_logratios / tokens[1].clamp(min=1.0)
        return (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
    return (
        -F.logsigmoid(beta * delta_score) * (1 - label_smoothing)
        - F.logsigmoid(-beta * delta_score) * label_smoothing
    )


def answers(seed: int) -> torch.Tensor:
    """Labels of 4 answers (2 pairs: chosen rows 0-1, rejected 2-3) after prompts of 3 to 8."""
    tokens = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(seed))
    for row, (prompt, padding) in enumerate([(3, 0), (5, 4), (8, 2), (4, 9)]):
        tokens[row, :prompt] = -100
        tokens[row, 24 - padding :] = -100
    return tokens


@pytest.mark.parametrize(
    "loss_type, label_smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)]
)
def test_dpo_on_chunked_log_probs_matches_trl(loss_type, label_smoothing):
    hidden, weight, A, B = leaves(
        3, (4, 24, HIDDEN), (VOCAB, HIDDEN), (RANK, HIDDEN), (VOCAB, RANK)
    )
    reference_hidden, reference_weight = leaves(4, (4, 24, HIDDEN), (VOCAB, HIDDEN))
    labels, adapter, beta = answers(5), adapter_of(A, B), 0.3
    options = DpoOptions(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    counts = (targets != -100).sum(-1).float()

    def pairs(values: torch.Tensor) -> PairLogProbs:
        return PairLogProbs(chosen=values[:2], rejected=values[2:])

    policy = chunked_token_log_probs(chunked_head(hidden, weight, adapter), labels, 8).sum(-1)
    with torch.no_grad():
        head = chunked_head(reference_hidden, reference_weight)
        reference = chunked_token_log_probs(head, labels, 8).sum(-1)
    result = dpo_losses(pairs(policy), pairs(reference), options, pairs(counts))

    def trl_logps(hidden, weight, adapter) -> torch.Tensor:
        logits = whole_logits(hidden, weight, adapter)
        per_token = selective_log_softmax(logits, targets.clamp(min=0))
        return (per_token * (targets != -100)).sum(-1)

    trl_policy = trl_logps(hidden, weight, adapter)
    trl_reference = trl_logps(reference_hidden, reference_weight, None).detach()
    trl = trl_dpo_losses(
        trl_policy.chunk(2), trl_reference.chunk(2), counts.chunk(2), beta, *options_of(options)
    )
    assert relative(result.losses, trl) <= TOLERANCE
    inputs = [hidden, weight, A, B]
    grads = gradients(result.losses.mean(), inputs)
    assert worst(grads, gradients(trl.mean(), inputs)) <= TOLERANCE
    metrics = result.metrics()
    chosen_rewards = beta * (trl_policy[:2] - trl_reference[:2]).detach()
    rejected_rewards = beta * (trl_policy[2:] - trl_reference[2:]).detach()
    assert relative(metrics["rewards/chosen"], chosen_rewards) <= TOLERANCE
    assert relative(metrics["rewards/rejected"], rejected_rewards) <= TOLERANCE
    margins = chosen_rewards - rejected_rewards
    assert relative(metrics["rewards/margins"], margins) <= TOLERANCE
    assert torch.equal(metrics["rewards/accuracies"], (margins > 0).float())
    assert relative(metrics["logps/chosen"], trl_policy[:2].detach()) <= TOLERANCE
    assert relative(metrics["logps/rejected"], trl_policy[2:].detach()) <= TOLERANCE


def options_of(options: DpoOptions) -> tuple[str, float]:
    return options.loss_type, options.label_smoothing


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(beta=0.0), "beta must be positive"),
        (dict(loss_type="hinge"), "loss_type must be one of"),
        (dict(label_smoothing=0.5), r"label_smoothing must lie in \[0, 0.5\)"),
        (dict(loss_type="ipo", label_smoothing=0.1), "sigmoid only, not ipo"),
    ],
)
def test_dpo_options_refuse_what_they_do_not_support(options, message):
    with pytest.raises(ValueError, match=message):
        DpoOptions(**options)


def reference_distillation(student_logits, teacher_logits, labels, temperature):
    """(CE sum, KL sum) on the whole logits: the teacher's and student's full-vocabulary
    log-softmaxes at T, ``F.kl_div`` summed over the labelled tokens."""
    targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()
    student_logits, teacher_logits = student_logits.flatten(0, 1), teacher_logits.flatten(0, 1)
    ce = F.cross_entropy(student_logits, targets, ignore_index=-100, reduction="sum")
    mask = targets != -100
    kl = F.kl_div(
        F.log_softmax(student_logits[mask] / temperature, -1),
        F.log_softmax(teacher_logits[mask] / temperature, -1),
        log_target=True,
        reduction="sum",
    )
    return ce, kl


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("lora", [False, True])
def test_distillation_sums_match_whole_logits(temperature, chunk, lora):
    hidden, weight, A, B = leaves(
        6, (2, 40, HIDDEN), (VOCAB, HIDDEN), (RANK, HIDDEN), (VOCAB, RANK)
    )
    teacher_hidden, teacher_weight = leaves(7, (2, 40, TEACHER_HIDDEN), (VOCAB, TEACHER_HIDDEN))
    adapter = adapter_of(A, B) if lora else None
    inputs = [hidden, weight, A, B] if lora else [hidden, weight]
    _, labels = batch(VOCAB)
    ce, kl = chunked_distillation_sums(
        hidden, weight, teacher_hidden, teacher_weight, labels, temperature, chunk, adapter=adapter
    )
    teacher_logits = F.linear(teacher_hidden, teacher_weight).detach()
    want_ce, want_kl = reference_distillation(
        whole_logits(hidden, weight, adapter), teacher_logits, labels, temperature
    )
    assert relative(ce, want_ce) <= TOLERANCE and relative(kl, want_kl) <= KD_TOLERANCE
    for alpha in (0.0, 0.5, 1.0):  # each term's gradient, and their weighted sum's
        loss = distillation_loss(ce, kl, 57, alpha, temperature)
        want = distillation_loss(want_ce, want_kl, 57, alpha, temperature)
        grads = gradients(loss, inputs)
        assert worst(grads, gradients(want, inputs)) <= KD_TOLERANCE, alpha
    # the teacher is frozen: no gradient reaches its hidden states or head
    assert teacher_hidden.grad is None and teacher_weight.grad is None


def test_distillation_loss_weighs_the_terms():
    ce, kl = torch.tensor(6.0), torch.tensor(2.0)
    assert distillation_loss(ce, kl, 4, 0.25, 3.0).item() == (0.25 * 6.0 + 0.75 * 9.0 * 2.0) / 4


def test_distillation_refuses_another_vocabulary_and_bad_values():
    hidden, weight = torch.randn(1, 6, 8), torch.randn(32, 8)
    labels = torch.randint(0, 32, (1, 6))
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(40\) must equal the student's"):
        chunked_distillation_sums(
            hidden, weight, torch.randn(1, 6, 4), torch.randn(40, 4), labels, 1.0
        )
    with pytest.raises(ValueError, match="temperature must be positive"):
        chunked_distillation_sums(hidden, weight, hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        distillation_loss(torch.tensor(1.0), torch.tensor(1.0), 1, 1.5, 1.0)


PREFERENCES = [
    {
        "prompt": [{"role": "user", "content": "what colour is the sky"}],
        "chosen": [{"role": "assistant", "content": "blue"}],
        "rejected": [{"role": "assistant", "content": "green grass"}],
    },
    {
        "prompt": [{"role": "user", "content": "grass?"}],
        "chosen": [{"role": "assistant", "content": "green"}],
        "rejected": [{"role": "assistant", "content": "the sky"}],
    },
]


def trl_trainer(
    tmp_path, loss_type: str, beta=0.3, reference_seed=1, peft_config=None, ref_model=None
):
    """TRL's ``DPOTrainer`` on a tiny Llama policy and another (seed ``reference_seed``, or
    ``ref_model`` when given) as its reference, or with ``peft_config`` the policy made a PEFT
    model by TRL (no reference model: the policy with its adapters off), with a byte-level
    tokenizer trained here; and its first batch (chosen rows, then rejected). fp32 throughout:
    TRL's default ``bf16`` would run the reference under accelerate's autocast."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    texts = ["the sky is blue", "grass is green", "what colour is the sky"]
    tokenizer = train_tokenizer(texts, 300, tmp_path / "tokenizer")
    config = tiny_config("llama", vocab_size=300)
    args = DPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[], beta=beta,
        loss_type=[loss_type], use_cpu=True, max_steps=1, save_strategy="no", bf16=False,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=build_causal_lm(config, seed=0),
        ref_model=reference_model(config, reference_seed, peft_config, ref_model),
        peft_config=peft_config,
        args=args,
        train_dataset=Dataset.from_list(PREFERENCES),
        processing_class=tokenizer,
    )
    return trainer, next(iter(trainer.get_train_dataloader()))


def reference_model(config, seed: int, peft_config, given) -> torch.nn.Module | None:
    """TRL's reference: ``given``, else None for a PEFT model, else a Llama of ``seed``."""
    if given is not None or peft_config is not None:
        return given
    return build_causal_lm(config, seed=seed)


def answer_log_probs(model, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, chunked (3 tokens at a time)."""
    with lm_head_skipped(model) as head:
        hidden = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
    return chunked_token_log_probs(chunked_head(hidden, head.weight), labels, 3).sum(-1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_equals_trl_dpo_trainer(tmp_path, loss_type):
    """TRL's own ``DPOTrainer.compute_loss`` on its own batch, and its gradients, against
    ``dpo_losses`` on the chunked answer log-probabilities of the same models and rows."""
    trainer, batch = trl_trainer(tmp_path, loss_type)
    policy, reference = trainer.model, trainer.ref_model
    trl_loss = trainer.compute_loss(policy, batch)
    trl_loss.backward()
    want = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad()

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    counts = (batch["completion_mask"] == 1).sum(-1).float()
    with torch.no_grad():
        reference_logps = answer_log_probs(reference, batch, labels)

    def pairs(values: torch.Tensor) -> PairLogProbs:
        return PairLogProbs(chosen=values[:2], rejected=values[2:])

    options = DpoOptions(beta=0.3, loss_type=loss_type)
    policy_logps = answer_log_probs(policy, batch, labels)
    loss = dpo_losses(pairs(policy_logps), pairs(reference_logps), options, pairs(counts))
    loss.losses.mean().backward()
    assert relative(loss.losses.mean().detach(), trl_loss.detach()) <= TOLERANCE
    got = {name: p.grad for name, p in policy.named_parameters()}
    assert max(relative(got[name], want[name]) for name in want) <= TOLERANCE
