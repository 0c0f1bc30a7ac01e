"""``recipes/distill.py``'s checks, in process and pure: a teacher whose vocabulary differs from
the student's (a size given, two folders whose tokenizers differ), a teacher that does not split
at the layout, and the layouts distillation does not run yet are each refused with their own
line naming the ``teacher.*`` key or the refused setting; a teacher of the student's tokenizer
passes."""

from pathlib import Path

import pytest

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.models import tiny_config
from components.runtime.problems import ConfigError
from recipes.compose import compose_distill
from recipes.distill_checks import check_distillation
from tests.saved_models import save_model


def refusals_of(compose, check, tmp_path: Path, *overrides: str) -> list[str]:
    """The lines a recipe's ``check`` refuses ``overrides`` with, as its ``compose`` makes the
    config (none: they pass)."""
    cfg = compose([f"output_dir={tmp_path / 'run'}", *overrides])
    try:
        check(cfg, None, None)
    except ConfigError as error:
        return [problem.message for problem in error.problems]
    return []


def refusals(tmp_path: Path, *overrides: str) -> list[str]:
    """The lines the distillation checks refuse ``overrides`` with (none: they pass)."""
    return refusals_of(compose_distill, check_distillation, tmp_path, *overrides)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama folders: two of one tokenizer (the teacher wider), one of another tokenizer."""
    root = tmp_path_factory.mktemp("models")
    one = train_tokenizer(["hello world", "fine tuning"], DEFAULT_VOCAB_SIZE, root / "one")
    other = train_tokenizer(["other words", "distillation"], DEFAULT_VOCAB_SIZE, root / "other")
    made = {}
    for name, tokenizer, width in (
        ("student", one, 64),
        ("teacher", one, 128),
        ("other", other, 128),
    ):
        config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=width)
        made[name] = save_model(root / name, config, tokenizer)
    return made


def test_a_teacher_vocabulary_size_other_than_the_students_is_refused(tmp_path):
    said = refusals(tmp_path, "teacher.config.vocab_size=300")
    assert said == [
        "teacher.config.vocab_size=300 must be the student's vocabulary (the tokenizer's, sized in "
        "preparation): use teacher.config.vocab_size=null (the student's)"
    ]
    said = refusals(tmp_path, "model.config.vocab_size=400", "teacher.config.vocab_size=300")
    assert said == [
        "teacher.config.vocab_size=300 must be the student's vocabulary (400): use "
        "teacher.config.vocab_size=null (the student's)"
    ]


def test_a_teacher_folder_of_another_tokenizer_is_refused(tmp_path, folders):
    student = f"model.pretrained_path={folders['student']}"
    assert (
        refusals(
            tmp_path, "model=pretrained", student, f"teacher.pretrained_path={folders['teacher']}"
        )
        == []
    )
    said = refusals(
        tmp_path, "model=pretrained", student, f"teacher.pretrained_path={folders['other']}"
    )
    assert len(said) == 1 and said[0].startswith(f"the teacher's vocabulary ({folders['other']}")
    assert "token by token" in said[0]


def test_a_teacher_that_does_not_split_at_the_layout_is_refused_as_the_teachers(tmp_path):
    said = refusals(
        tmp_path,
        "tp=4",
        "teacher.config.num_attention_heads=4",
        "teacher.config.num_key_value_heads=2",
        "teacher.config.head_dim=32",
    )
    assert said and all(line.startswith("teacher") for line in said), said


def test_the_layouts_distillation_does_not_run_are_refused(tmp_path):
    said = refusals(tmp_path, "pp=2", "train.global_batch_size=16")
    assert said == [
        "pp=2 is not run by distill.py: the teacher has no pipeline stages of its own: use pp=1"
    ]
    assert refusals(tmp_path, "dry_run=true") == []  # planned with its teacher


def test_a_teacher_still_to_be_downloaded_is_refused_in_one_line(tmp_path):
    """The checks have no effect: a Hub id not in the cache would be fetched by the preparation,
    before which the teacher cannot be checked against the student; distill.py says so."""
    found = refusals(tmp_path, "teacher.pretrained_path=shardtune-tests/not-in-any-cache")
    assert found == [
        "teacher: recipes/distill.py does not download from the Hugging Face Hub or convert "
        "SmolLM2 yet, and this model is not in the cache: fetch it first (`hf download "
        "OWNER/NAME`, or one recipes/finetune.py run with it as the model), or give a local folder"
    ]
