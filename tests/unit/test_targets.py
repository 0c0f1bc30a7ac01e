"""One way to build a ``_target_``: a class the group can build, or one line saying what to do."""

import sys

import pytest
import torch

from components.targets import TargetError, check_target, target_class


def test_a_target_names_a_subclass_of_the_groups_base():
    adamw = target_class("optim", "torch.optim.AdamW", base=torch.optim.Optimizer)
    assert adamw is torch.optim.AdamW


@pytest.mark.parametrize(
    "target",
    [
        "torch.optim.Adamm",  # misspelt
        "no_such_package.Optimizer",  # not installed
        "os.system",  # not a class
        "torch.nn.Linear",  # a class, not an optimizer
        "torch",  # a module
        "",
    ],
)
def test_anything_else_is_one_line_naming_the_key_and_the_fix(target, capsys):
    with pytest.raises(TargetError) as error:
        target_class("optim", target, base=torch.optim.Optimizer)
    fix = "is not a class the optim group can build: pick one with optim=NAME"
    assert str(error.value) == f"optim._target_={target!r} {fix}"
    assert capsys.readouterr().err == ""  # hydra's own log of the failed lookup stays quiet


def test_a_registry_target_is_never_imported():
    registry = {"components.data.sources.JsonlSource": dict}
    target = "tests.unit.never_imported_module.Source"
    expected = rf"^data\._target_='{target}' is not a data source: use one of components\.data"
    with pytest.raises(TargetError, match=expected):
        target_class("data", target, registry=registry, kind="a data source")
    assert "tests.unit.never_imported_module" not in sys.modules
    assert target_class("data", "components.data.sources.JsonlSource", registry=registry) is dict


def test_check_target_lists_every_unknown_option_with_the_accepted_ones():
    options = {"lr": 1e-3, "betass": (0.9, 0.95), "momentum": 0.9}
    errors = check_target("optim", "torch.optim.AdamW", options, torch.optim.Optimizer, {"params"})
    assert [error.split(";")[0] for error in errors] == [
        "optim.betass is not an option of torch.optim.AdamW",
        "optim.momentum is not an option of torch.optim.AdamW",
    ]
    accepted = errors[0].split("; its options: ")[1].split(", ")
    assert "betas" in accepted and "params" not in accepted  # params: passed by the recipe
    sgd = {"momentum": 0.9}
    assert check_target("optim", "torch.optim.SGD", sgd, torch.optim.Optimizer, set()) == []
