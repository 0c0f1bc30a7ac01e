"""``recipes/distill.py``'s checks and preparation, on fine-tuning's: the config against the
distillation schema (``recipes/schema.py``: ``teacher``, ``distill``), what distillation does not
run yet, the teacher as a model of its own (``components/models/checks.py``: its folder or config,
its TP plan at the run's layout, its vocabulary against the student's), every problem one
``error:`` line before any rank starts; then fine-tuning's preparation and the teacher's spec.
Imported once the command line is read (``recipes/distill.py``), as ``recipes/checks.py`` is;
what the model checks and the preparation import comes after the schema has passed, so a misspelt
key costs what it costs ``finetune.py``.
"""

import copy
from dataclasses import fields, replace
from typing import Any

from omegaconf import DictConfig

from components.models.families import moe_patterns
from components.models.options import ModelChoice
from components.problems import Problem
from components.runtime.output_dir import OutputDirLock
from components.runtime.problems import ConfigError, say
from recipes.checks import check
from recipes.distill_schema import DistillConfig
from recipes.plan import DistillChecked, DistillPlan, RunPlan, model_choice, model_use


def check_distillation(
    cfg: DictConfig,
    job_dir: str | None,
    hydra_run_dir: str | None,
    schema: type[DistillConfig] = DistillConfig,
) -> DistillChecked:
    """Fine-tuning's checks of ``cfg`` against the distillation ``schema`` (with what
    distillation does not run: ``DistillConfig.unsupported``), then the teacher
    (``components.models.checks``)."""
    checked = check(cfg, job_dir, hydra_run_dir, schema)
    from components.models.checks import CheckedModel, awaits_fetch, check_teacher  # schema passed

    settings, dims = checked.settings, checked.dims
    student = CheckedModel(path=checked.model_path, config=checked.model_config)
    choice = teacher_choice(settings)
    unfetched = {"model": checked.model_awaits_fetch, "teacher": awaits_fetch(choice)}
    if found := teacher_family_problems(settings) + unfetched_problems(unfetched):
        raise ConfigError(found)  # the teacher cannot be built, or checked against the student
    use = replace(model_use(settings, checked.device_type), lora=None, peft_lora=False)
    built_vocab = settings.model.config.get("vocab_size")  # a built student's; null: tokenizer's
    teacher = check_teacher(choice, use, dims, student, built_vocab)
    for note in teacher.notes:
        say(note)
    found += teacher.problems + head_problems(checked.model_config, teacher.config)
    if found:
        raise ConfigError(found)
    base = {field.name: getattr(checked, field.name) for field in fields(checked)}
    return DistillChecked(**base, teacher_path=teacher.path, teacher_config=teacher.config)


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


def unfetched_problems(unfetched: dict[str, bool]) -> list[Problem]:
    """A student or teacher folder still to be downloaded from the Hub or converted (SmolLM2):
    the teacher is checked against the student's folder before any effect, which fine-tuning's
    preparation alone takes (``recipes/prepare.py``), so distillation refuses it for now."""
    return [
        Problem(
            key=key,
            message=f"{key}: recipes/distill.py does not download from the Hugging Face Hub or "
            "convert SmolLM2 yet, and this model is not in the cache: fetch it first (`hf download "
            "OWNER/NAME`, or one recipes/finetune.py run with it as the model), or give a local "
            "folder",
        )
        for key, waiting in unfetched.items()
        if waiting
    ]


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


def prepare_distillation(checked: DistillChecked) -> tuple[DistillPlan, OutputDirLock | None]:
    """Fine-tuning's preparation (tokenizer, data, output folder, checkpoint), then the teacher's
    spec: its folder, or its config with the student's vocabulary."""
    from recipes.prepare import model_spec, prepare  # datasets, tokenizers: after the checks

    plan, lock = prepare(checked)
    config = copy.deepcopy(checked.teacher_config)
    if checked.teacher_path is None:  # built: the student's vocabulary, the tokenizer's size
        config.vocab_size = plan.model.config.vocab_size
    experts, routers = moe_patterns(config, None, None)  # the teacher's family's
    spec = model_spec(plan.settings, config, checked.teacher_path)
    spec = replace(spec, experts=tuple(experts), routers=tuple(routers))
    spec = replace(spec, activation_checkpointing="none", pp_stages_per_rank=1)
    base = {field.name: getattr(plan, field.name) for field in fields(RunPlan)}
    return DistillPlan(**base, teacher=spec), lock
