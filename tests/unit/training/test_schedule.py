"""LR schedules by name: warmup_cosine unchanged, transformers' names built as transformers builds
them, and the pre-launch check's error lines (warmup longer than the run, unknown names and
options)."""

import math

import pytest
import torch
from transformers import get_scheduler

from components.training.schedule import SCHEDULES, build_schedule, check_schedule, warmup_cosine


def optimizer(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def learning_rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def test_warmup_cosine_by_name_is_the_formula():
    rates = learning_rates(
        build_schedule(optimizer(), "warmup_cosine", 4, 12, {"min_lr_ratio": 0.1}), 12
    )
    expected = [0.5 * (s + 1) / 4 for s in range(4)]
    expected += [
        0.5 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 8))) for s in range(4, 12)
    ]
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)
    assert rates == learning_rates(warmup_cosine(optimizer(), 4, 12, 0.1), 12)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("linear", {}),
        ("cosine", {}),
        ("constant_with_warmup", {}),
        (
            "warmup_stable_decay",
            {"num_decay_steps": 4, "min_lr_ratio": 0.2, "decay_type": "linear"},
        ),
    ],
)
def test_transformers_names_match_get_scheduler(name, options):
    ours = learning_rates(build_schedule(optimizer(), name, 3, 10, options), 10)
    theirs = learning_rates(
        get_scheduler(name, optimizer(), 3, 10, scheduler_specific_kwargs=options), 10
    )
    assert ours == theirs
    assert ours[0] < ours[3] == 0.5  # rises over the 3 warmup steps to the peak


def test_warmup_stable_decay_shape():
    options = {"num_decay_steps": 4, "min_lr_ratio": 0.0, "decay_type": "linear"}
    rates = learning_rates(
        build_schedule(optimizer(1.0), "warmup_stable_decay", 2, 10, options), 10
    )
    assert rates[2:6] == [1.0] * 4  # stable phase at the peak
    assert rates[6:] == sorted(rates[6:], reverse=True) and rates[-1] < 0.5


def test_warmup_as_long_as_the_run_is_allowed_longer_is_an_error():
    assert check_schedule("warmup_cosine", 5, 5, {"min_lr_ratio": 0.1}) == []
    errors = check_schedule("warmup_cosine", 6, 5, {"min_lr_ratio": 0.1})
    assert errors == [
        "train.warmup_steps=6 is longer than the run (train.max_steps=5); use at most 5 warmup "
        "steps"
    ]
    with pytest.raises(ValueError, match="longer than the run"):
        build_schedule(optimizer(), "linear", 6, 5, {})


def test_unknown_names_and_options_are_error_lines():
    assert check_schedule("cosine_annealing", 1, 5, {})[0].startswith(
        "schedule='cosine_annealing' is not a known"
    )
    assert check_schedule("linear", 1, 5, {"min_lr_ratio": 0.1}) == [
        "schedule.min_lr_ratio is not an option of schedule 'linear' (its options: none)"
    ]
    assert check_schedule("warmup_stable_decay", 1, 5, {}) == [
        "schedule 'warmup_stable_decay' needs schedule.num_decay_steps, e.g. "
        "+schedule.num_decay_steps=..."
    ]
    assert (
        "longer than the run"
        in check_schedule("warmup_stable_decay", 2, 5, {"num_decay_steps": 4})[0]
    )
    assert "use constant_with_warmup" in check_schedule("constant", 2, 5, {})[0]
    assert (
        "min_lr" in check_schedule("cosine_with_min_lr", 1, 5, {})[0]
    )  # transformers' own check, one line
    assert "reduce_lr_on_plateau" not in SCHEDULES


def test_scheduler_state_round_trips():
    first = build_schedule(optimizer(), "warmup_stable_decay", 2, 10, {"num_decay_steps": 4})
    learning_rates(first, 5)
    second = build_schedule(optimizer(), "warmup_stable_decay", 2, 10, {"num_decay_steps": 4})
    second.load_state_dict(first.state_dict())
    assert learning_rates(second, 5) == learning_rates(first, 5)


BILLION = 1_000_000_000
NEGATIVE = "gives a negative or non-finite learning rate"


@pytest.mark.timeout(60)  # the check once stepped a scheduler max_steps times: hours for a billion
def test_a_billion_steps_are_checked_without_walking_them():
    assert check_schedule("warmup_cosine", 10, BILLION, {"min_lr_ratio": 0.1}) == []
    assert check_schedule("warmup_stable_decay", 10, BILLION, {"num_decay_steps": 10**8}) == []
    assert check_schedule("warmup_cosine", 10, BILLION, {"min_lr_ratio": -0.5}) == [
        f"schedule=warmup_cosine with {{'min_lr_ratio': -0.5}} {NEGATIVE}"
    ]
    assert "min_lr" in check_schedule("cosine_with_min_lr", 1, BILLION, {})[0]


def test_the_sampled_check_finds_a_factor_that_goes_negative_only_at_the_end():
    # min_lr_ratio=-0.01: positive for all but the last few percent of the run, negative at its end
    assert check_schedule("warmup_cosine", 1, 1000, {"min_lr_ratio": -0.01}) == [
        f"schedule=warmup_cosine with {{'min_lr_ratio': -0.01}} {NEGATIVE}"
    ]
