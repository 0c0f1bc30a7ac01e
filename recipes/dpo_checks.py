"""``recipes/dpo.py``'s checks and preparation, on fine-tuning's: ``dpo.reference_path``, a frozen
reference of its own, checked as a model (its folder, its TP plan at the run's layout), then
against the policy (the same architecture, the same vocabulary token for token), every problem
one ``error:`` line before any rank starts; then fine-tuning's preparation and the reference's
spec: that folder's, the policy's starting weights, or none with ``peft=lora`` (the policy with
its adapters off). A policy still to be downloaded or converted is fetched first in preparation,
as fine-tuning's model is, and the reference compared with it then. Imported once the command
line is read (``recipes/dpo.py``); the model checks and the preparation after the schema has
passed, so a misspelt key costs what it costs ``finetune.py``.
"""

import copy
from dataclasses import fields, replace
from pathlib import Path

from omegaconf import DictConfig

from components.models.hub import not_a_model
from components.models.options import ModelChoice
from components.problems import Problem
from components.runtime.output_dir import OutputDirLock
from components.runtime.problems import ConfigError
from recipes.checks import check
from recipes.dpo_schema import DpoConfig
from recipes.plan import Checked, DpoChecked, DpoPlan, RunPlan, model_choice, model_use
from recipes.resume_record import RecipeRecord, frozen_record

KEY = "dpo.reference_path"


def check_dpo(
    cfg: DictConfig,
    job_dir: str | None,
    hydra_run_dir: str | None,
    schema: type[DpoConfig] = DpoConfig,
) -> DpoChecked:
    """Fine-tuning's checks of ``cfg`` against the DPO ``schema``, then the reference folder
    ``dpo.reference_path`` names, if any (:func:`with_reference`)."""
    checked = check(cfg, job_dir, hydra_run_dir, schema)
    base = {field.name: getattr(checked, field.name) for field in fields(checked)}
    path = checked.settings.dpo.reference_path
    if path is None:
        return DpoChecked(**base, reference_path=None, reference_config=None)
    folder = Path(path).expanduser().absolute()
    awaits = checked.model_awaits_fetch  # compared with the policy once preparation fetched it
    unchecked = DpoChecked(
        **base, reference_path=folder, reference_config=None, reference_awaits_fetch=awaits
    )
    if not awaits:
        return with_reference(unchecked)
    if found := folder_problems(checked, folder):
        raise ConfigError(found)
    return unchecked


def with_reference(checked: DpoChecked) -> DpoChecked:
    """``checked`` with its reference folder checked as a model of its own at the run's layout
    (no adapters), then against the policy's folder: the same model type, the same vocabulary;
    in a dry run, what the reference refuses at the layouts it may suggest added to the policy's
    facts (``with_frozen_model_refusals``). Raises ConfigError with every problem found."""
    from components.models.checks import (  # the schema has passed
        check_model,
        vocabulary_difference,
        with_frozen_model_refusals,
    )

    folder = checked.reference_path
    if found := folder_problems(checked, folder):
        raise ConfigError(found)
    attention = checked.settings.model.attn_implementation  # the policy's kernel, as its spec's
    choice = ModelChoice(name=KEY, family=None, config={}, attn_implementation=attention)
    choice = replace(choice, pretrained_path=str(folder))
    use = model_use(checked.settings, checked.device_type, checked.dims)  # dry run's layouts too
    reference = check_model(choice, replace(use, lora=None, peft_lora=False), checked.dims)
    found = [
        Problem(key=KEY, message=f"{KEY}: {problem.message}") for problem in reference.problems
    ]
    if reference.config is None:
        raise ConfigError(found)
    policy_type, own_type = checked.model_config.model_type, reference.config.model_type
    if own_type != policy_type:
        message = f"the reference is a {own_type} model and the policy a {policy_type} one"
        found.append(_mismatch(folder, message))
    elif which := vocabulary_difference(_policy(checked), reference):
        found.append(_mismatch(folder, f"their vocabularies' {which} differ"))
    if found:
        raise ConfigError(found)
    return replace(
        checked,
        reference_path=reference.path,
        reference_config=reference.config,
        reference_awaits_fetch=False,
        model_facts=with_frozen_model_refusals(checked.model_facts, reference, KEY, checked.dims),
    )


def folder_problems(checked: Checked, folder: Path) -> list[Problem]:
    """The reference must be a local model folder, and the policy one too (or one still to be
    fetched, compared in preparation): a policy built from ``model.config`` gets its tokenizer
    in preparation, so the vocabularies cannot be compared before the run."""
    if not (folder / "config.json").is_file():
        return [
            Problem(
                key=KEY,
                message=f"{KEY}={folder}: {not_a_model(folder)} (a local folder: a Hub id is "
                "not downloaded for the reference)",
            )
        ]
    if checked.model_path is not None or checked.model_awaits_fetch:
        return []
    message = (
        f"{KEY}={folder} is checked against the policy's vocabulary before the run, but the "
        f"policy (model={checked.settings.model.name}) is built from model.config, its "
        "tokenizer trained only in preparation: give the policy a folder (model=pretrained "
        "model.pretrained_path=...)"
    )
    return [Problem(key=KEY, message=message)]


def _mismatch(folder: Path, what: str) -> Problem:
    message = (
        f"{KEY}={folder}: {what}: the reference must be of the policy's architecture and "
        "vocabulary (DPO compares their log-probabilities token by token)"
    )
    return Problem(key=KEY, message=message)


def _policy(checked: Checked):
    from components.models.checks import CheckedModel  # (see with_reference)

    return CheckedModel(path=checked.model_path, config=checked.model_config)


def resume_record(checked: DpoChecked) -> RecipeRecord:
    """What DPO adds to its checkpoints' record: the reference's weights (a resume against another
    reference is refused: another objective) and the loss's settings, ``dpo.*`` but the
    reference's path (a resume may change them, with a ``note:``)."""
    dpo = checked.settings.dpo
    settings = {f"dpo.{key}": value for key, value in dpo.model_dump().items()}
    del settings[KEY]
    if checked.reference_path is not None:
        where, folder = f"{KEY}={checked.reference_path}", checked.reference_path
    else:
        folder = checked.model_path  # None: built from model.config with the run's seed
        where = f"the policy's starting weights ({folder or 'built from model.config'})"
    model = checked.settings.model
    built = {"family": model.family, "config": model.config}
    reference = frozen_record(where, folder, built, model_choice(checked.settings).cache_dir)
    return RecipeRecord(frozen={"reference": reference}, settings=settings)


def prepare_dpo(checked: DpoChecked) -> tuple[DpoPlan, OutputDirLock | None]:
    """A policy still to be downloaded or converted fetched (fine-tuning's fetch) and the
    reference folder checked against it then (:func:`with_reference`); fine-tuning's
    preparation (tokenizer, data, output folder, checkpoint); then the reference's spec: its
    folder's, the policy's own (its starting weights), or None with ``peft=lora`` (the policy
    with its adapters off)."""
    from recipes.prepare import fetched_model, model_spec, prepare  # after the checks

    if checked.reference_awaits_fetch:
        checked = with_reference(fetched_model(checked))
    elif checked.model_awaits_fetch:  # its folder is the reference's record (resume_record)
        checked = fetched_model(checked)
    plan, lock = prepare(checked, resume_record(checked))
    reference = None if plan.lora is not None else plan.model
    if checked.reference_path is not None:
        config = copy.deepcopy(checked.reference_config)
        reference = model_spec(plan.settings, config, checked.reference_path)
    base = {field.name: getattr(plan, field.name) for field in fields(RunPlan)}
    return DpoPlan(**base, reference=reference), lock
