"""``recipes/distill.py``'s checks and preparation, on fine-tuning's: the config against the
distillation schema (``recipes/schema.py``: ``teacher``, ``distill``), what distillation does not
run yet, and beside the student's checks the teacher's as a model of its own
(``recipes/distill_teacher.py``: its folder or config, its TP plan and experts at the run's layout,
its vocabulary against the student's), every problem of both in one ``error:`` line before any
rank starts; then fine-tuning's preparation and the teacher's spec. A student or teacher still to
be downloaded or converted is fetched first in preparation, as fine-tuning's model is, and the
teacher checked then, still before any rank starts. Imported once the command line is read
(``recipes/distill.py``), as ``recipes/checks.py`` is; what the teacher's checks and the
preparation import comes after the schema has passed, so a misspelt key costs what it costs
``finetune.py``.
"""

import copy
from dataclasses import fields, replace
from types import ModuleType
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from components.distributed.layout import ParallelDims
from components.models.families import moe_patterns
from components.problems import show
from components.runtime.output_dir import OutputDirLock
from components.runtime.problems import ConfigError
from recipes.checks import check_beside
from recipes.distill_schema import DistillConfig
from recipes.plan import DistillChecked, DistillPlan, RunPlan
from recipes.resume_record import RecipeRecord, frozen_record

if TYPE_CHECKING:  # transformers' models: imported once the schema has passed
    from components.models.checks import CheckedModel


def teacher_checks() -> ModuleType:
    """``recipes.distill_teacher``, imported once the schema has passed (transformers' models)."""
    from recipes import distill_teacher

    return distill_teacher


def checked_teacher(
    settings: DistillConfig, dims: ParallelDims | None, device_type: str, student: "CheckedModel"
) -> "CheckedModel":
    """The teacher as checked at ``dims`` beside the ``student`` as checked, its problems with it
    (``recipes.distill_teacher.checked_teacher``, imported once the schema has passed)."""
    return teacher_checks().checked_teacher(settings, dims, device_type, student)


def check_distillation(
    cfg: DictConfig,
    job_dir: str | None,
    hydra_run_dir: str | None,
    schema: type[DistillConfig] = DistillConfig,
) -> DistillChecked:
    """Fine-tuning's checks of ``cfg`` against the distillation ``schema`` (with what
    distillation does not run: ``DistillConfig.DEGREES_AT_ONE``) with the teacher's beside them
    (``recipes/distill_teacher.py``): now, or in preparation when a folder is still to be
    fetched. Raises ConfigError with every problem of both."""
    checked, teacher = check_beside(cfg, job_dir, hydra_run_dir, schema, beside=checked_teacher)
    base = {field.name: getattr(checked, field.name) for field in fields(checked)}
    unchecked = DistillChecked(**base, teacher_path=None, teacher_config=None)
    return teacher_checks().with_teacher(unchecked, teacher)


def resume_record(checked: DistillChecked) -> RecipeRecord:
    """What distillation adds to its checkpoints' record: the teacher's weights (a resume with
    another teacher is refused: another objective) and ``distill.*`` (a resume may change them,
    with a ``note:``). A built teacher is identified by its family and sizes as resolved
    (``teacher_choice``), never by the layout."""
    distill = checked.settings.distill.model_dump()
    settings = {f"distill.{key}": value for key, value in distill.items()}
    folder = checked.teacher_path
    choice = teacher_checks().teacher_choice(checked.settings)
    where = f"{folder}" if folder else f"built from teacher.config={show(choice.config)}"
    built = {"family": choice.family, "config": choice.config}
    record = frozen_record(where, folder, built, choice.cache_dir)
    return RecipeRecord(frozen={"teacher": record}, settings=settings)


def prepare_distillation(checked: DistillChecked) -> tuple[DistillPlan, OutputDirLock | None]:
    """The student and the teacher downloaded or converted if still to be (fine-tuning's fetch)
    and the teacher checked then; fine-tuning's preparation (tokenizer, data, output folder,
    checkpoint); then the teacher's spec: its folder, or its config with the student's
    vocabulary."""
    from recipes.prepare import (
        fetch_problems,
        fetched_model,
        model_spec,
        prepare,
    )  # after the checks

    teacher = teacher_checks()
    if checked.teacher_awaits_fetch:
        checked = fetched_model(checked) if checked.model_awaits_fetch else checked
        settings = checked.settings
        if found := fetch_problems(teacher.teacher_choice(settings), section="teacher"):
            raise ConfigError(found)
        student = teacher.fetched_student(checked)
        found = teacher.checked_teacher(settings, checked.dims, checked.device_type, student)
        checked = teacher.with_teacher(checked, found)
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
