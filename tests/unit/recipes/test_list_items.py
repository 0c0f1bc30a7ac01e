"""A wrong item of a list-valued key is refused in its list, with its position: never as if that
item were the key's whole value (``profile.steps=0`` for ``profile.steps=[0,1]``)."""

import pytest

from recipes.compose import compose
from recipes.validate import SchemaError, validate

STEPS_HINT = "use null (off) or [FIRST, LAST], 1-based steps of the run, e.g. profile.steps=[2,3]"


def refusal(overrides: list[str]) -> str:
    with pytest.raises(SchemaError) as refused:
        validate(compose(overrides))
    return str(refused.value)


def test_a_step_0_is_named_in_its_list_with_what_works():
    assert refusal(["profile.steps=[0,1]"]) == (
        "profile.steps=[0, 1] is not valid (its item 1 is 0: input should be greater than or "
        f"equal to 1): {STEPS_HINT}"
    )
    assert refusal(["profile.steps=[1,0]"]).startswith(
        "profile.steps=[1, 0] is not valid (its item 2 is 0: "
    )


def test_an_empty_pattern_is_named_in_its_list():
    assert refusal(["model.experts=[a,'']"]).startswith(
        "model.experts=['a', ''] is not valid (its item 2 is '': string should have at least 1 "
        "character): use null (the family's) or a list of module patterns"
    )


def test_a_list_of_the_wrong_length_is_shown_whole_as_before():
    assert (
        refusal(["profile.steps=[1,2,3]"]) == f"profile.steps=[1, 2, 3] is not valid: {STEPS_HINT}"
    )
