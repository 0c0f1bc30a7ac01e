"""A section of keys (``distill``, ``train``) or a config group (``optim``, ``peft``) given a value
on the command line is refused in the project's words, the same for every section and group of
every recipe: set the section's keys (one shown as an example), or choose one of the group's
options; never pydantic's "Input should be a valid dictionary" nor Hydra's traceback."""

import pytest

from recipes.compose import compose, compose_distill, compose_dpo
from recipes.distill_schema import DistillConfig
from recipes.dpo_schema import DpoConfig
from recipes.validate import SchemaError, validate

RECIPES = {
    "finetune.py": (compose, None),
    "distill.py": (compose_distill, DistillConfig),
    "dpo.py": (compose_dpo, DpoConfig),
}


def refusal(script: str, override: str) -> str:
    """The schema's line for ``override`` in the recipe ``script``."""
    make, schema = RECIPES[script]
    with pytest.raises(SchemaError) as refused:
        validate(make([override]), *(schema,) if schema else ())
    return str(refused.value)


@pytest.mark.parametrize(
    ("script", "override", "example"),
    [
        ("distill.py", "distill=0.5", "distill.alpha=0.5"),
        ("distill.py", "teacher=null", "teacher.config.hidden_size=256"),
        ("dpo.py", "dpo=0.5", "dpo.beta=0.1"),
        ("finetune.py", "train=0.5", "train.max_steps=60"),
        ("finetune.py", "profile=3", "profile.steps=[2,3]"),
        ("finetune.py", "moe=null", "moe.routing_bias_rate=0.001"),
    ],
)
def test_a_section_given_a_value_is_told_to_set_its_keys(script, override, example):
    section, _, value = override.partition("=")
    assert refusal(script, override) == (
        f"{section}={value} is not valid: {section} is a section, not a value: set its keys, "
        f"e.g. {example} (`.venv/bin/python recipes/{script} --cfg job` lists them)"
    )


@pytest.mark.parametrize(
    ("override", "options"),
    [
        ("optim=0.5", "adamw, adamw4bit, adamw8bit, adamw_bf16, sgd"),
        ("peft=null", "lora, none, qlora"),
        ("data=true", "default, hf, jsonl, mix, preference"),
    ],
)
def test_a_config_group_given_a_value_is_told_its_options(capsys, override, options):
    with pytest.raises(SystemExit) as stopped:
        compose_distill([override])
    group, _, value = override.partition("=")
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {group}={value} is not valid: {group} is a config group: choose one of its "
        f"options, {group}= takes one of {options}"
    )
