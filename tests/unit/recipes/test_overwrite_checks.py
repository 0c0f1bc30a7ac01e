"""A model folder the run reads, among the run files ``overwrite_output_dir=true`` removes before
the run starts (a run's own ``hf/`` given back as its model, teacher or reference), is refused in
one line by the checks: removed, it could not be loaded (the trial: the run deleted the model,
then failed loading it). Elsewhere, or without the overwrite, it passes."""

import shutil

import pytest

from recipes.checks import check
from recipes.compose import compose, compose_distill, compose_dpo
from recipes.distill_checks import check_distillation
from recipes.dpo_checks import check_dpo
from tests.saved_models import reference_folders
from tests.unit.recipes.test_distill_checks import refusals_of

RECIPES = {  # the key naming the folder -> the recipe's compose and checks, and its other keys
    "model.pretrained_path": (compose, check, ["model=pretrained"]),
    "teacher.pretrained_path": (compose_distill, check_distillation, []),
    "dpo.reference_path": (compose_dpo, check_dpo, ["model=pretrained"]),
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return reference_folders(tmp_path_factory.mktemp("models"))["policy"]


@pytest.mark.parametrize("key", list(RECIPES))
def test_a_model_folder_among_the_run_files_an_overwrite_removes_is_refused(tmp_path, policy, key):
    compose_recipe, check_recipe, more = RECIPES[key]
    exported = tmp_path / "run" / "hf"  # refusals_of's output_dir is tmp_path / "run"
    shutil.copytree(policy, exported)
    (tmp_path / "run" / "run.json").write_text("{}")
    policy_path = (
        [] if key == "model.pretrained_path" or not more else [f"model.pretrained_path={policy}"]
    )

    def lines(folder, *overwrite: str) -> list[str]:
        given = [*more, *policy_path, f"{key}={folder}", *overwrite]
        return refusals_of(compose_recipe, check_recipe, tmp_path, *given)

    assert (
        f"{key}={exported} lies in {tmp_path / 'run'}'s run files, which overwrite_output_dir=true "
        "removes before the run starts: copy the folder out of it, or choose another output_dir"
    ) in lines(exported, "overwrite_output_dir=true")
    for passing in (lines(policy, "overwrite_output_dir=true"), lines(exported)):
        assert not any("overwrite_output_dir=true removes" in line for line in passing)
