"""``recipes/distill.py``'s checks and preparation, on fine-tuning's: the config against the
distillation schema (``recipes/schema.py``: ``teacher``, ``distill``), what distillation does not
run yet, the teacher as a model of its own (``components/models/checks.py``: its folder or config,
its TP plan at the run's layout, its vocabulary against the student's), every problem one
``error:`` line before any rank starts; then fine-tuning's preparation and the teacher's spec. A
student or teacher still to be downloaded or converted is fetched first in preparation, as
fine-tuning's model is, and the teacher checked then, still before any rank starts.
Imported once the command line is read (``recipes/distill.py``), as ``recipes/checks.py`` is;
what the model checks and the preparation import comes after the schema has passed, so a misspelt
key costs what it costs ``finetune.py``.
"""

import copy
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from components.models.families import moe_patterns
from components.models.options import ModelChoice
from components.problems import Problem, show
from components.runtime.output_dir import OutputDirLock
from components.runtime.problems import ConfigError, say
from recipes.checks import check
from recipes.distill_schema import DistillConfig
from recipes.plan import DistillChecked, DistillPlan, RunPlan, model_choice, model_use
from recipes.resume_record import RecipeRecord, frozen_record


def check_distillation(
    cfg: DictConfig,
    job_dir: str | None,
    hydra_run_dir: str | None,
    schema: type[DistillConfig] = DistillConfig,
) -> DistillChecked:
    """Fine-tuning's checks of ``cfg`` against the distillation ``schema`` (with what
    distillation does not run: ``DistillConfig.unsupported``), then the teacher
    (:func:`with_teacher`): now, or in preparation when a folder is still to be fetched."""
    checked = check(cfg, job_dir, hydra_run_dir, schema)
    if found := teacher_family_problems(checked.settings):
        raise ConfigError(found)  # the teacher cannot be built
    base = {field.name: getattr(checked, field.name) for field in fields(checked)}
    return with_teacher(DistillChecked(**base, teacher_path=None, teacher_config=None))


def with_teacher(checked: DistillChecked) -> DistillChecked:
    """``checked`` with its teacher checked (``components.models.checks``: its folder or config,
    its TP plan at the run's layout, its vocabulary against the student's; both heads), or, when
    the student or the teacher is still to be downloaded or converted, marked
    ``teacher_awaits_fetch``: the preparation fetches both, then checks it here. Raises
    ConfigError with every problem found."""
    from components.models.checks import (  # the schema has passed
        CheckedModel,
        awaits_fetch,
        check_teacher,
        vocabulary_problems,
        with_frozen_model_refusals,
    )

    settings, choice = checked.settings, teacher_choice(checked.settings)
    student = CheckedModel(path=checked.model_path, config=checked.model_config)
    if checked.model_awaits_fetch or awaits_fetch(choice):  # no effect in the checks
        if checked.model_path is None and not checked.model_awaits_fetch:  # refused unfetched
            hub_teacher = CheckedModel(path=Path(choice.pretrained_path))
            raise ConfigError(vocabulary_problems(student, hub_teacher, None, None))
        return replace(checked, teacher_awaits_fetch=True)
    use = model_use(settings, checked.device_type, checked.dims)  # the dry run's layouts too
    use = replace(use, lora=None, peft_lora=False)
    built_vocab = settings.model.config.get("vocab_size")  # a built student's; null: tokenizer's
    teacher = check_teacher(choice, use, checked.dims, student, built_vocab)
    for note in teacher.notes:
        say(note)
    if found := teacher.problems + head_problems(checked.model_config, teacher.config):
        raise ConfigError(found)
    facts = with_frozen_model_refusals(checked.model_facts, teacher, "teacher", checked.dims)
    return replace(
        checked,
        teacher_path=teacher.path,
        teacher_config=teacher.config,
        teacher_awaits_fetch=False,
        model_facts=facts,  # the dry run suggests no layout the teacher cannot take
    )


def teacher_choice(settings: DistillConfig) -> ModelChoice:
    """The ``teacher`` group as the model checks read a model: built from ``teacher.config`` of
    ``teacher.family`` (null: the student's), or from its folder; its attention transformers'
    default (SDPA where its class has it, packed rows as a dense mask)."""
    teacher, family = settings.teacher, settings.teacher.family or settings.model.family
    cache_dir = model_choice(settings).cache_dir
    return ModelChoice(
        name="teacher",
        family=family,
        config=teacher.config,
        attn_implementation=None,  # transformers' default (sdpa): the teacher runs forward only
        pretrained_path=teacher.pretrained_path,
        cache_dir=cache_dir,
    )


def teacher_family_problems(settings: DistillConfig) -> list[Problem]:
    """A teacher built from its config needs a family: its own, or the student's."""
    teacher = settings.teacher
    if teacher.pretrained_path is not None or teacher.family or settings.model.family:
        return []
    why = f"teacher.family is null and model={settings.model.name} names no family either"
    return [Problem(key="teacher.family", message=f"{why}: set teacher.family, e.g. llama")]


def head_problems(student_config: Any, teacher_config: Any) -> list[Problem]:
    """Both heads must be ones the chunked loss computes: a plain linear ``lm_head`` of a family
    whose forward ends in it (``PLAIN_HEAD_FAMILIES``), no soft-capped logits."""
    from components.distributed.chunked_loss import PLAIN_HEAD_FAMILIES  # DTensor: after checks

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


def resume_record(checked: DistillChecked) -> RecipeRecord:
    """What distillation adds to its checkpoints' record: the teacher's weights (a resume with
    another teacher is refused: another objective) and ``distill.*`` (a resume may change them,
    with a ``note:``)."""
    settings = {
        f"distill.{key}": value for key, value in checked.settings.distill.model_dump().items()
    }
    teacher, folder = checked.settings.teacher, checked.teacher_path
    where = (
        f"{folder}" if folder is not None else f"built from teacher.config={show(teacher.config)}"
    )
    built = {"family": teacher.family or checked.settings.model.family, "config": teacher.config}
    record = frozen_record(where, folder, built)
    return RecipeRecord(frozen={"teacher": record}, settings=settings)


def prepare_distillation(checked: DistillChecked) -> tuple[DistillPlan, OutputDirLock | None]:
    """The student and the teacher downloaded or converted if still to be (fine-tuning's fetch)
    and the teacher checked then (:func:`with_teacher`); fine-tuning's preparation (tokenizer,
    data, output folder, checkpoint); then the teacher's spec: its folder, or its config with the
    student's vocabulary."""
    from recipes.prepare import (
        fetch_problems,
        fetched_model,
        model_spec,
        prepare,
    )  # after the checks

    if checked.teacher_awaits_fetch:
        checked = fetched_model(checked) if checked.model_awaits_fetch else checked
        if found := fetch_problems(teacher_choice(checked.settings), section="teacher"):
            raise ConfigError(found)
        checked = with_teacher(checked)
    plan, lock = prepare(checked, resume_record(checked))
    config = copy.deepcopy(checked.teacher_config)
    if checked.teacher_path is None:  # built: the student's vocabulary, the tokenizer's size
        config.vocab_size = plan.model.config.vocab_size
    experts, routers = moe_patterns(config, None, None)  # the teacher's family's
    spec = model_spec(plan.settings, config, checked.teacher_path)
    spec = replace(spec, experts=tuple(experts), routers=tuple(routers))
    spec = replace(spec, activation_checkpointing="none", pp_stages_per_rank=1)
    base = {field.name: getattr(plan, field.name) for field in fields(RunPlan)}
    return DistillPlan(**base, teacher=spec), lock
