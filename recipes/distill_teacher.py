"""``recipes/distill.py``'s teacher as a model of its own (docs/distillation.md): the ``teacher``
group read as the model checks read a model, its default sizes (its family's tiny ones,
``conf/model/``, twice as wide and deep), and its checks beside the student's: its folder or
config, its TP plan and experts at the run's layout, its vocabulary and head against the
student's, every problem named by a ``teacher.*`` key. Imported once the schema has passed
(``recipes/distill_checks.py``): it imports transformers' models.
"""

from dataclasses import replace
from pathlib import Path
from typing import Any

from components.distributed.chunked_loss import PLAIN_HEAD_FAMILIES
from components.distributed.layout import ParallelDims
from components.models.checks import (
    CheckedModel,
    as_teacher,
    awaits_fetch,
    check_teacher,
    vocabulary_problems,
    with_frozen_model_refusals,
)
from components.models.families import FAMILIES, moe_patterns
from components.models.options import ModelChoice
from components.moe.checks import expert_parallel_problems
from components.problems import Problem
from components.runtime.problems import ConfigError, say
from recipes.distill_schema import DistillConfig
from recipes.plan import DistillChecked, model_choice, model_use
from recipes.tiny_models import tiny_group

# The family of a teacher built from its config when teacher.family is null (not given).
BUILT_FAMILY = "llama"
# The built teacher's default: its family's tiny model (conf/model/<family>.yaml's sizes) this many
# times as wide and deep, so that it is bigger than the tiny student of the same family.
TEACHER_SCALE = 2
SCALED = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "head_dim",
)


def teacher_sizes(family: str) -> dict[str, Any]:
    """The built teacher's default sizes of ``family``: its tiny group's, :data:`SCALED` ones
    times :data:`TEACHER_SCALE`, the experts' counts as they are; no vocabulary (the
    student's)."""
    sizes = dict(tiny_group(family)["config"])
    sizes.pop("vocab_size", None)
    return {key: value * TEACHER_SCALE if key in SCALED else value for key, value in sizes.items()}


def teacher_choice(settings: DistillConfig) -> ModelChoice:
    """The ``teacher`` group as the model checks read a model: its folder (``teacher.config`` not
    read; ``teacher.family``, if given, checked against it: :func:`folder_family_problems`), or
    built from :func:`teacher_sizes` of ``teacher.family`` (null: :data:`BUILT_FAMILY`) with the
    keys ``teacher.config`` sets (not null) over them; its attention transformers' default (SDPA
    where its class has it, packed rows as a dense mask)."""
    teacher, family = settings.teacher, settings.teacher.family
    given = {key: value for key, value in teacher.config.items() if value is not None}
    sizes = {} if teacher.pretrained_path is not None else given  # a folder's: not read
    if teacher.pretrained_path is None:
        family = family or BUILT_FAMILY
    if teacher.pretrained_path is None and family in FAMILIES:  # else refused by the checks
        sizes = {**teacher_sizes(family), **given}
        sizes["vocab_size"] = teacher.config.get("vocab_size")  # null: the student's
    return ModelChoice(
        name="teacher",
        family=family,
        config=sizes,
        attn_implementation=None,  # transformers' default (sdpa): the teacher runs forward only
        pretrained_path=teacher.pretrained_path,
        cache_dir=model_choice(settings).cache_dir,
    )


def unused_config_note(settings: DistillConfig) -> str | None:
    """The ``note:`` for the ``teacher.config`` keys set (not null) beside a teacher folder, whose
    ``config.json`` decides; None when none is."""
    teacher = settings.teacher
    given = [f"teacher.config.{key}" for key, value in teacher.config.items() if value is not None]
    if teacher.pretrained_path is None or not given:
        return None
    return (
        f"note: {', '.join(given)} not used: the teacher's folder "
        f"(teacher.pretrained_path={teacher.pretrained_path}) has its own config.json"
    )


def folder_family_problems(settings: DistillConfig, teacher: CheckedModel) -> list[Problem]:
    """A ``teacher.family`` given beside a teacher folder must be the folder's family (its
    config.json's ``model_type``), which decides: another is refused, never ignored."""
    given, folder = settings.teacher.family, settings.teacher.pretrained_path
    if given is None or folder is None or teacher.config is None:
        return []
    folder_family = teacher.config.model_type
    if given == folder_family:
        return []
    message = (
        f"teacher.family={given} is not the family of the teacher's folder "
        f"(teacher.pretrained_path={folder}), whose config.json decides: it is a {folder_family} "
        f"model; leave teacher.family null (the folder's) or set teacher.family={folder_family}"
    )
    return [Problem(key="teacher.family", message=message)]


def checked_teacher(
    settings: DistillConfig, dims: ParallelDims | None, device_type: str, student: CheckedModel
) -> CheckedModel:
    """The teacher checked beside the ``student`` (as its checks left it) at the layout ``dims``
    (None: refused): its folder or config, its TP plan and experts, its vocabulary and both heads;
    ``awaits_fetch`` when the student or the teacher is still to be downloaded or converted (the
    preparation checks it then). Its notes are printed."""
    choice = teacher_choice(settings)
    if student.awaits_fetch or awaits_fetch(choice):  # no effect in the checks
        if student.path is None and not student.awaits_fetch:  # refused unfetched
            hub_teacher = CheckedModel(path=Path(choice.pretrained_path))
            return CheckedModel(problems=vocabulary_problems(student, hub_teacher, None, None))
        return CheckedModel(awaits_fetch=True)
    use = replace(model_use(settings, device_type, dims), lora=None, peft_lora=False)
    built_vocab = settings.model.config.get("vocab_size")  # a built student's; null: tokenizer's
    teacher = check_teacher(choice, use, dims, student, built_vocab)
    for note in [unused_config_note(settings), *teacher.notes]:
        if note:
            say(note)
    if teacher.config is not None:
        teacher.problems += folder_family_problems(settings, teacher)
        teacher.problems += head_problems(student.config, teacher.config)
        teacher.problems += expert_problems(settings, dims, student, teacher)
    at_cp = [size for name, size in use.other_layouts if name == "cp"]  # a dry run's
    for size in at_cp if teacher.experts else ():  # refused as expert_problems refuses cp
        teacher.refusals[("cp", size)] = (
            *teacher.refusals.get(("cp", size), ()),
            moe_teacher_at_cp(size),
        )
    return teacher


def expert_problems(
    settings: DistillConfig, dims: ParallelDims | None, student: CheckedModel, teacher: CheckedModel
) -> list[Problem]:
    """The teacher's experts at ``dims``: split over ep as the student's are (and refused with cp
    as theirs are); ep > 1 where neither model has experts refused, naming both."""
    if dims is None or not teacher.complete:
        return []
    if teacher.experts:
        found = expert_parallel_problems(teacher.meta, teacher.experts, dims.ep)
        found = [as_teacher(problem) for problem in found]
        if dims.cp > 1:
            found.append(Problem(key="cp", message=moe_teacher_at_cp(dims.cp)))
        return found
    if dims.ep == 1 or student.experts or not student.complete:
        return []
    message = (
        f"ep={dims.ep} needs an MoE model: neither the student (model={settings.model.name}) nor "
        f"the teacher (a {teacher.config.model_type} model) has experts; use ep=1, or an MoE "
        "student (model=qwen3_moe) or teacher (teacher.family=qwen3_moe)"
    )
    return [Problem(key="ep", message=message)]


def moe_teacher_at_cp(cp: int) -> str:
    """Why an MoE teacher does not run at ``cp`` (as ``finetune.py`` refuses cp with an MoE
    model): the checks' line, and the dry run's at each cp it may suggest."""
    return f"cp={cp} with an MoE teacher is not supported yet: use cp=1"


def head_problems(student_config: Any, teacher_config: Any) -> list[Problem]:
    """Both heads must be ones the chunked loss computes: a plain linear ``lm_head`` of a family
    whose forward ends in it (``PLAIN_HEAD_FAMILIES``), no soft-capped logits."""
    found = []
    for key, config in (("model", student_config), ("teacher", teacher_config)):
        capped = getattr(config, "final_logit_softcapping", None) is not None
        if config is not None and (config.model_type not in PLAIN_HEAD_FAMILIES or capped):
            families = ", ".join(PLAIN_HEAD_FAMILIES)
            message = (
                f"{key}: model type '{config.model_type}' is not supported by recipes/distill.py: "
                f"its KL runs on a plain linear lm_head over the split vocabulary ({families})"
            )
            found.append(Problem(key=key, message=message))
    return found


def with_teacher(checked: DistillChecked, teacher: CheckedModel) -> DistillChecked:
    """``checked`` with its ``teacher`` as checked (:func:`checked_teacher`), or marked
    ``teacher_awaits_fetch``; in a dry run, what the teacher refuses at the layouts it may
    suggest added to the student's facts. Raises ConfigError with the teacher's problems."""
    if teacher.problems:
        raise ConfigError(teacher.problems)
    if teacher.awaits_fetch:
        return replace(checked, teacher_awaits_fetch=True)
    facts = with_frozen_model_refusals(checked.model_facts, teacher, "teacher", checked.dims)
    return replace(
        checked,
        teacher_path=teacher.path,
        teacher_config=teacher.config,
        teacher_awaits_fetch=False,
        model_facts=facts,  # the dry run suggests no layout the teacher cannot take
    )


def fetched_student(checked: DistillChecked) -> CheckedModel:
    """The student of ``checked`` (its folder fetched) as the teacher's checks read it."""
    model = checked.settings.model
    experts, _ = moe_patterns(checked.model_config, model.experts, model.routers)
    config, path = checked.model_config, checked.model_path
    return CheckedModel(complete=True, path=path, config=config, experts=tuple(experts))
