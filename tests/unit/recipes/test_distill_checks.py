"""``recipes/distill.py``'s checks, in process and pure: a teacher whose vocabulary differs from
the student's (a size given, two folders whose tokenizers differ), a teacher that does not split
at the layout, and the layouts distillation does not run yet are each refused with their own
line naming the ``teacher.*`` key or the refused setting; a teacher of the student's tokenizer
passes."""

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from components.models.families import FAMILIES
from components.runtime.problems import ConfigError
from recipes.compose import compose_distill
from recipes.distill_checks import check_distillation, prepare_distillation
from recipes.tiny_models import tiny_config
from tests.saved_models import save_model

SHA = "0123456789abcdef0123456789abcdef01234567"
STUDENT_ID, TEACHER_ID = "shardtune-tests/student", "shardtune-tests/teacher"


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


def test_a_dense_student_takes_ep_for_an_moe_teachers_experts(tmp_path):
    """Expert parallelism splits the experts of either model: a dense student's layers are not
    split over ep, an MoE teacher's experts are; neither with experts is refused, naming both."""
    moe_teacher = ("teacher.family=qwen3_moe", "tp=2", "ep=2")
    assert refusals(tmp_path, *moe_teacher) == []
    cfg = compose_distill([f"output_dir={tmp_path / 'run'}", "dry_run=true", *moe_teacher])
    plan, _ = prepare_distillation(check_distillation(cfg, None, None))
    assert plan.dims.ep == 2 and plan.model.experts == ()  # the student: nothing split over ep
    assert plan.teacher.experts == ("model.layers.*.mlp.experts",)  # the teacher's, split
    assert refusals(tmp_path, *moe_teacher, "+teacher.config.num_experts=3") == [
        "teacher: ep (2) must divide the number of experts (3)"
    ]
    assert refusals(tmp_path, "teacher.family=qwen3_moe", "cp=2", "nproc=2") == [
        "cp=2 with an MoE teacher is not supported yet: use cp=1"
    ]
    assert refusals(tmp_path, "tp=2", "ep=2") == [
        "ep=2 needs an MoE model: neither the student (model=llama) nor the teacher (a llama "
        "model) has experts; use ep=1, or an MoE student (model=qwen3_moe) or teacher "
        "(teacher.family=qwen3_moe)"
    ]


def test_the_teachers_problems_are_listed_with_the_students(tmp_path):
    said = refusals(
        tmp_path, "dry_run=true", "tp=8", "dp=4", "teacher.config.num_key_value_heads=2"
    )
    assert "tp (8) must divide num_key_value_heads (4)" in said  # the student's
    assert "teacher: tp (8) must divide num_key_value_heads (2)" in said


def test_teacher_lines_name_the_teacher_keys(tmp_path):
    assert refusals(tmp_path, "teacher.family=gpt5") == [
        "teacher.family='gpt5' is not a known family: use one of llama, mistral, mixtral, qwen2, "
        "qwen3, qwen3_moe"
    ]
    assert refusals(tmp_path, "+teacher.config.num_experts=4") == [
        "teacher.config.num_experts is not a key of LlamaConfig: remove it"
    ]


def test_a_teacher_folder_notes_only_the_teacher_config_keys_set(tmp_path, folders, capsys):
    pair = ("model=pretrained", f"model.pretrained_path={folders['student']}")
    teacher = f"teacher.pretrained_path={folders['teacher']}"
    assert refusals(tmp_path, *pair, teacher) == []
    assert "teacher.config" not in capsys.readouterr().out
    assert refusals(tmp_path, *pair, teacher, "teacher.config.hidden_size=256") == []
    assert (
        f"note: teacher.config.hidden_size not used: the teacher's folder ({teacher}) has its "
        "own config.json" in capsys.readouterr().out.splitlines()
    )


def test_a_teacher_family_beside_a_teacher_folder_must_be_the_folders(tmp_path, folders):
    """The folder's config.json decides the teacher's family: a ``teacher.family`` given beside it
    that names another is refused, not ignored; the folder's own passes; left null (the
    default) it is the folder's, and a built teacher's is llama whatever the student's."""
    pair = ("model=pretrained", f"model.pretrained_path={folders['student']}")
    teacher = f"teacher.pretrained_path={folders['teacher']}"
    assert compose_distill([]).teacher.family is None
    assert refusals(tmp_path, *pair, teacher, "teacher.family=qwen3") == [
        f"teacher.family=qwen3 is not the family of the teacher's folder ({teacher}), whose "
        "config.json decides: it is a llama model; leave teacher.family null (the folder's) or "
        "set teacher.family=llama"
    ]
    assert refusals(tmp_path, *pair, teacher, "teacher.family=llama") == []
    assert refusals(tmp_path, *pair, teacher) == []
    cfg = compose_distill([f"output_dir={tmp_path / 'run'}", "model=qwen3"])
    assert check_distillation(cfg, None, None).teacher_config.model_type == "llama"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_built_teacher_is_tiny_in_every_family(tmp_path, family):
    """Its family's tiny sizes (``conf/model/``; Llama's for mistral and qwen2) at twice the
    width, depth and head size, the experts' counts as they are (not transformers' defaults:
    128 experts of Qwen3-MoE)."""
    cfg = compose_distill([f"output_dir={tmp_path / 'run'}", f"teacher.family={family}"])
    config = check_distillation(cfg, None, None).teacher_config
    assert config.model_type == family
    sizes = ("hidden_size", "num_hidden_layers", "intermediate_size", "head_dim")
    assert [getattr(config, key) for key in sizes] == [128, 4, 256, 16]
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    assert experts in ((8,) if family in ("qwen3_moe", "mixtral") else (None,))
    assert getattr(config, "moe_intermediate_size", 128) == 128


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, online: a Hub id not in it is still to be downloaded (the
    preparation's effect). Nothing reaches the network: a test puts the id's snapshot in the cache,
    standing for the download, before the preparation looks."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


def downloaded(folder: Path, cache: Path, repo_id: str) -> Path:
    """``folder`` as ``hf download repo_id`` leaves it in ``cache``: its snapshot at main."""
    owner, name = repo_id.split("/")
    repo = cache / f"models--{owner}--{name}"
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return repo / "snapshots" / SHA


def checked_hub_ids(tmp_path: Path, student: str, teacher: str, *overrides: str):
    """The distillation checks of a student and a teacher named by Hub id or folder."""
    cfg = compose_distill(
        [
            f"output_dir={tmp_path / 'run'}",
            f"cache_dir={tmp_path / 'cache'}",
            "model=pretrained",
            f"model.pretrained_path={student}",
            f"teacher.pretrained_path={teacher}",
            *overrides,
        ]
    )
    return check_distillation(cfg, None, None)


def test_a_student_and_teacher_still_to_be_downloaded_are_fetched_then_checked(
    tmp_path, folders, hub
):
    """The checks have no effect: both Hub ids, not in the cache, are left to the preparation,
    which fetches both (fine-tuning's fetch) and checks the teacher against the student then."""
    checked = checked_hub_ids(tmp_path, STUDENT_ID, TEACHER_ID, "dry_run=true")
    assert checked.model_awaits_fetch and checked.teacher_awaits_fetch
    assert checked.teacher_config is None and not any(hub.iterdir())
    student = downloaded(folders["student"], hub, STUDENT_ID)
    teacher = downloaded(folders["teacher"], hub, TEACHER_ID)
    plan, lock = prepare_distillation(checked)
    assert lock is None and plan.model.weights == student and plan.teacher.weights == teacher
    assert (plan.model.config.hidden_size, plan.teacher.config.hidden_size) == (64, 128)


def test_a_downloaded_teacher_of_another_tokenizer_is_refused_before_the_folder_is_claimed(
    tmp_path, folders, hub
):
    checked = checked_hub_ids(tmp_path, folders["student"], TEACHER_ID)
    assert checked.teacher_awaits_fetch and not checked.model_awaits_fetch
    teacher = downloaded(folders["other"], hub, TEACHER_ID)
    with pytest.raises(ConfigError) as refused:
        prepare_distillation(checked)
    [said] = [problem.message for problem in refused.value.problems]
    assert said.startswith(f"the teacher's vocabulary ({teacher}") and "token by token" in said
    assert not (tmp_path / "run").exists()  # refused before the output folder is claimed


def test_a_teacher_that_cannot_be_downloaded_is_refused_in_one_line(tmp_path, folders, hub):
    """Checked online (left to the preparation), fetched offline: the download fails, one line
    naming ``teacher.pretrained_path``."""
    checked = checked_hub_ids(tmp_path, folders["student"], TEACHER_ID)
    constants.HF_HUB_OFFLINE = True  # monkeypatched by ``hub``: restored after the test
    with pytest.raises(ConfigError) as refused:
        prepare_distillation(checked)
    assert [problem.message for problem in refused.value.problems] == [
        f"teacher.pretrained_path='{TEACHER_ID}' is not a local folder and is not in the Hugging "
        f"Face cache (offline): looked in {hub}; download it where a network is (`hf download "
        f"{TEACHER_ID}`) into that cache (HF_HOME / HF_HUB_CACHE), or set teacher.pretrained_path "
        "to a local folder"
    ]


def test_a_teacher_to_download_for_a_student_built_from_its_config_is_refused_unfetched(
    tmp_path, hub
):
    """A built student's tokenizer is trained only in preparation: no teacher folder can be
    checked against it, so the checks refuse it before any download."""
    found = refusals(tmp_path, f"teacher.pretrained_path={TEACHER_ID}")
    assert len(found) == 1 and found[0].startswith(
        f"teacher.pretrained_path={TEACHER_ID} with a student built from model.config is not "
        "supported"
    )
