"""``peft.merge=true`` with an adapter on a head the model ties to its input embeddings is refused
in one line by the checks (merged, the one weight would change the embeddings too: the trial's
merged hf/ was 1.45e-3 off the trained model); untied, or the head left out, or not merged,
it passes. qlora alike."""

import pytest

from recipes.checks import check
from recipes.compose import compose
from tests.unit.recipes.test_distill_checks import refusals_of

TIED = "model.config.tie_word_embeddings=true"
HEAD = "peft.target_modules=[lm_head,*.q_proj]"
REFUSED = (
    "peft.merge=true with an adapter on lm_head, which this model ties to its input embeddings "
    "(tie_word_embeddings): merged, the one weight would change the embeddings too: use "
    "peft.merge=false (adapter/ alone is the trained model), or leave lm_head out of "
    "peft.target_modules"
)


@pytest.mark.parametrize("peft", ["peft=lora", "peft=qlora"])
def test_merging_an_adapter_on_a_tied_head_is_refused_in_one_line(tmp_path, peft):
    assert refusals_of(compose, check, tmp_path, peft, TIED, HEAD, "peft.merge=true") == [REFUSED]
    for passing in (
        [peft, HEAD, "peft.merge=true"],  # untied
        [peft, TIED, "peft.target_modules=[*.q_proj]", "peft.merge=true"],  # the head left out
        [peft, TIED, HEAD],  # not merged: adapter/ alone
    ):
        assert refusals_of(compose, check, tmp_path, *passing) == [], passing
