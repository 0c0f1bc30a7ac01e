"""An MoE model's load balance: its router's auxiliary loss joins the backward, and each step's
imbalance is counted."""

import pytest
import torch

from components.models import build_causal_lm
from components.moe import ExpertLoad, load_balancing_loss, load_metrics, router_aux_loss_weight
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.tiny_models import tiny_config

EXPERTS = ["model.layers.*.mlp.experts"]


def batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = tokens.clone()
    labels[:, :3] = -100
    return tokens, labels, int((labels[:, 1:] != -100).sum())


def watched(family: str):
    """A tiny MoE model of ``family``, its config, and an ExpertLoad counting its experts."""
    config = tiny_config(family)
    model = build_causal_lm(config, seed=0)
    return config, model, ExpertLoad.watch(model, config, EXPERTS, dp_group=None)


def imbalance(load: ExpertLoad) -> float:
    """End the step and read its imbalance, as the recipe does."""
    return load_metrics(load.end_step())["expert_imbalance"]


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def test_the_aux_loss_the_config_enables_trains_like_hugging_faces_own_loss():
    config = tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    tokens, labels, labelled = batch(config.vocab_size)
    weight = router_aux_loss_weight(config, micro_batches=1, dp=1)
    ours = build_causal_lm(config, seed=0)
    forward_backward(ours, tokens, labels, labelled, aux_loss_weight=weight)
    theirs = build_causal_lm(config, seed=0)
    theirs(input_ids=tokens, labels=labels, use_cache=False).loss.backward()  # CE mean + coef * aux
    without = build_causal_lm(config, seed=0)
    forward_backward(without, tokens, labels, labelled)  # weight 0: the aux loss left out

    router = "model.layers.0.mlp.gate.weight"
    ours, theirs, without = gradients(ours), gradients(theirs), gradients(without)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert (ours[router] - without[router]).abs().max() > 1e-4  # the aux loss moved the router


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_aux_loss_of_a_padded_batch_is_hugging_faces_with_its_attention_mask(family):
    """Right padding the recipe adds (row 2's last 6 positions): the load-balancing loss over the
    real tokens is the one the model computes given the batch's attention mask, its gradients
    too (1e-5); the model's own without a mask, which counts the padding, is not."""
    config = tiny_config(family, output_router_logits=True, router_aux_loss_coef=0.5)
    tokens, labels, labelled = batch(config.vocab_size)
    real = torch.ones_like(tokens, dtype=torch.bool)
    real[1, 10:] = False
    labels[1, 10:] = -100
    labelled = int((labels[:, 1:] != -100).sum())
    weight = router_aux_loss_weight(config, micro_batches=1, dp=1)
    ours = build_causal_lm(config, seed=0)
    forward_backward(ours, tokens, labels, labelled, aux_loss_weight=weight, real=real)
    theirs = build_causal_lm(config, seed=0)  # its CE is the mean over the same labels
    mask = real.long()
    theirs(input_ids=tokens, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    unmasked = build_causal_lm(config, seed=0)
    forward_backward(unmasked, tokens, labels, labelled, aux_loss_weight=weight)

    router = "model.layers.0.mlp.gate.weight"
    ours, theirs, unmasked = gradients(ours), gradients(theirs), gradients(unmasked)
    torch.testing.assert_close(ours[router], theirs[router], rtol=1e-5, atol=1e-7)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (unmasked[router] - theirs[router]).abs().max() > 1e-4  # the padding counted


def test_a_mask_of_another_size_than_the_routed_tokens_is_an_error():
    config = tiny_config("qwen3_moe", output_router_logits=True)
    model = build_causal_lm(config, seed=0)
    tokens, labels, _ = batch(config.vocab_size)
    outputs = model(input_ids=tokens, use_cache=False)
    with pytest.raises(RuntimeError, match="32 tokens were routed but the real-token mask has 16"):
        load_balancing_loss(model, outputs, torch.ones(1, 16, dtype=torch.bool))
    assert load_balancing_loss(model, outputs, None) is outputs.aux_loss  # the model's own


def test_the_aux_loss_weight_spreads_the_coefficient_over_micro_batches_and_dp_ranks():
    enabled = tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.25)
    assert router_aux_loss_weight(enabled, micro_batches=2, dp=4) == 0.25 / 8
    assert (
        router_aux_loss_weight(tiny_config("qwen3_moe"), micro_batches=1, dp=1) == 0.0
    )  # off by default
    assert router_aux_loss_weight(tiny_config("llama"), micro_batches=1, dp=1) == 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_imbalance_is_max_over_mean_tokens_per_expert_of_the_worst_layer(family):
    config, model, load = watched(family)
    tokens, labels, labelled = batch(config.vocab_size)
    forward_backward(model, tokens, labels, labelled)
    counts = load.counts.clone()
    assert (
        counts.sum(dim=1).tolist()
        == [tokens.numel() * config.num_experts_per_tok] * config.num_hidden_layers
    )
    expected = max((row.max() / row.double().mean()).item() for row in counts)
    assert imbalance(load) == expected
    assert load.counts.sum() == 0  # reset for the next step

    for layer in (
        model.model.layers
    ):  # a zero router picks experts 0 and 1 for every token: 8 / 2 = 4x the mean
        torch.nn.init.zeros_(layer.mlp.gate.weight)
    forward_backward(model, tokens, labels, labelled)
    evaluate_loss_sum(model, tokens, labels)  # validation (no gradients) is not counted
    assert imbalance(load) == 4.0
    assert load.counts.sum() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_padding_is_not_counted_and_real_tokens_count_as_without_it(family):
    config, model, load = watched(family)
    tokens, labels, _ = batch(config.vocab_size)
    real = [
        11,
        16,
    ]  # row 0: 11 real tokens then 5 of padding (causal: they cannot change the real ones' routing)
    for row, length in enumerate(real):  # each row alone, unpadded
        forward_backward(model, tokens[row : row + 1, :length], labels[row : row + 1, :length], 1)
    unpadded = load.counts.clone()
    load.counts.zero_()
    padded = tokens.clone()
    padded[0, real[0] :] = 0
    load.count_real(torch.arange(16) < torch.tensor(real).unsqueeze(1))
    forward_backward(model, padded, labels, 1)
    assert (
        load.counts.sum(dim=1).tolist()
        == [sum(real) * config.num_experts_per_tok] * config.num_hidden_layers
    )
    assert torch.equal(load.counts, unpadded)
    load.count_real(
        torch.ones(3, 16, dtype=torch.bool)
    )  # a mask of another batch is a bug, said out loud
    with pytest.raises(
        RuntimeError, match="32 tokens were routed but the real-token mask has 48 positions"
    ):
        forward_backward(model, tokens, labels, 1)


def test_a_dense_model_has_no_expert_load():
    config = tiny_config("llama")
    assert ExpertLoad.watch(build_causal_lm(config, seed=0), config, [], dp_group=None) is None


def test_the_trackers_get_each_layers_imbalance_and_each_experts_share():
    config, model, load = watched("qwen3_moe")
    tokens, labels, labelled = batch(config.vocab_size)
    forward_backward(model, tokens, labels, labelled)
    counts = load.counts.clone().double()
    record = load_metrics(load.end_step(), per_expert=True)
    layers = config.num_hidden_layers
    for n in range(layers):
        expected = (counts[n].max() / counts[n].mean()).item()
        assert record[f"expert_imbalance/layer_{n}"] == pytest.approx(expected)
        shares = [record[f"expert_load/layer_{n}/expert_{e}"] for e in range(config.num_experts)]
        assert shares == pytest.approx((counts[n] / counts[n].sum()).tolist())
    worst = max(record[f"expert_imbalance/layer_{n}"] for n in range(layers))
    assert record["expert_imbalance"] == worst
    assert len(record) == 1 + layers + layers * config.num_experts
    assert load.counts.sum() == 0


ROUTERS = ["model.layers.*.mlp.gate"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_zero_routing_bias_routes_exactly_as_the_router(family):
    config = tiny_config(family)
    tokens, labels, labelled = batch(config.vocab_size)
    plain = build_causal_lm(config, seed=0)
    biased = build_causal_lm(config, seed=0)
    ExpertLoad.watch(biased, config, EXPERTS, dp_group=None, routers=ROUTERS, bias_rate=1e-3)
    hidden = torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(0))
    routed = biased.model.layers[0].mlp.gate(hidden), plain.model.layers[0].mlp.gate(hidden)
    for ours, theirs in zip(*routed, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    loss = forward_backward(biased, tokens, labels, labelled)
    assert loss == forward_backward(plain, tokens, labels, labelled)
    ours, theirs = gradients(biased), gradients(plain)
    assert ours.keys() == theirs.keys()
    for name, gradient in theirs.items():
        assert torch.equal(ours[name], gradient), name


def test_the_bias_picks_the_experts_but_the_weights_stay_the_routers():
    config = tiny_config("qwen3_moe")
    model = build_causal_lm(config, seed=0)
    ExpertLoad.watch(model, config, EXPERTS, dp_group=None, routers=ROUTERS, bias_rate=1e-3)
    router = model.model.layers[0].mlp.gate
    hidden = torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(0))
    router.routing_bias[[3, 5]] = 10.0  # every token now picks experts 3 and 5
    logits, weights, chosen = router(hidden)
    assert (chosen.sort(dim=-1).values == torch.tensor([3, 5])).all()
    expected = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)  # unbiased
    if router.norm_topk_prob:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected.to(weights.dtype))


def test_each_step_moves_the_bias_against_the_load():
    config = tiny_config("qwen3_moe")
    tokens, labels, labelled = batch(config.vocab_size)
    model = build_causal_lm(config, seed=0)
    load = ExpertLoad.watch(model, config, EXPERTS, dp_group=None, routers=ROUTERS, bias_rate=0.01)
    forward_backward(model, tokens, labels, labelled)
    counts = load.counts[0].clone()
    assert torch.equal(load.end_step()[0], counts)  # the step's end: no metrics read needed
    bias = model.model.layers[0].mlp.gate.routing_bias
    mean = counts.double().mean()
    expected = torch.where(counts > mean, -0.01, torch.where(counts < mean, 0.01, 0.0)).float()
    assert torch.equal(bias, expected)
    names = [f"model.layers.{n}.mlp.gate.routing_bias" for n in range(config.num_hidden_layers)]
    assert set(names) <= set(model.state_dict())  # saved with the model in every checkpoint
    assert model._keys_to_ignore_on_save == names  # but not in an HF export


def test_the_bias_alone_spreads_a_peaked_router_out():
    config = tiny_config("qwen3_moe")
    tokens, labels, labelled = batch(config.vocab_size)
    model = build_causal_lm(config, seed=0)
    load = ExpertLoad.watch(model, config, EXPERTS, dp_group=None, routers=ROUTERS, bias_rate=0.01)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(5)  # a peaked router: some experts take far more tokens
    seen = []
    for _ in range(10):  # no optimizer step: only the bias moves
        forward_backward(model, tokens, labels, labelled)
        seen.append(imbalance(load))
    assert seen[0] > 2.0 and max(seen[-3:]) < 0.8 * seen[0], seen


def test_experts_handed_routed_tokens_without_a_router_beside_them_are_not_counted():
    """JetMoE's experts take tokens already routed, with per-expert counts, and its gating module
    holds its linear one level down (no router found): they are named, not counted; a model whose
    every experts module is such has no expert load to watch."""
    from components.models import meta_causal_lm as meta
    from components.models.families import moe_patterns
    from components.moe import uncounted_experts
    from tests.coverage import tiny_config as coverage_config

    config = coverage_config("jetmoe")
    model = meta(config)
    experts, routers = moe_patterns(config, None, None)
    assert uncounted_experts(model, list(experts), routers) == [
        f"model.layers.{i}.{part}"
        for i in (0, 1)
        for part in (
            "mlp.input_linear",
            "mlp.output_linear",
            "self_attention.experts.input_linear",
            "self_attention.experts.output_linear",
        )
    ]
    assert ExpertLoad.watch(model, config, list(experts), None, routers) is None
