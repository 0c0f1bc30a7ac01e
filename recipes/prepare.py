"""The run's effects, once, before any rank trains (in the launcher, or on rank 0 of a torchrun
world while the others wait): train a tokenizer when the model has none, tokenize into the cache,
claim ``output_dir`` and choose the checkpoint to resume from; the result is the frozen run plan.

Bad data shows only here (a record too long, a file that does not parse): it is refused with the
same ``error:`` line as the checks' problems, before the folder is claimed.
"""

import copy
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from components.data import DataError, PreparedData, cached_tokenizer, prepare_data
from components.data.sources import (
    DataSource,
    EmbeddedPreferenceSource,
    GeneratedSource,
    MixSource,
)
from components.data.stream_mixture import StreamedMixSplit
from components.data.streaming import StreamedSplit, check_dp_parts
from components.distributed.layout import ParallelDims
from components.models import meta_causal_lm
from components.models.checks import checked_plan, fetch_model_folder, tp_problems
from components.models.configs import vocab_size_for
from components.models.families import moe_patterns
from components.models.options import ModelChoice
from components.models.parallelize import ModelSpec
from components.problems import Problem, show
from components.runtime.output_dir import OutputDirLock
from components.runtime.problems import ConfigError, say
from recipes.checks import model_problems
from recipes.outputs import (
    OwnershipError,
    choose_checkpoint,
    layout_cuts,
    own_output_dir,
    run_info,
)
from recipes.plan import Checked, RunPlan, Settled, model_choice
from recipes.resume_record import RecipeRecord
from recipes.schema import Config


def prepare(
    checked: Checked, recipe: RecipeRecord | None = None
) -> tuple[RunPlan, OutputDirLock | None]:
    """The plan of a checked run, and the lock on its ``output_dir`` (None in a dry run, which
    claims nothing); ``recipe``: what a recipe's own parts add to its checkpoints' record (its
    frozen models, its loss settings). Raises ConfigError for data the checks could not see."""
    if checked.model_awaits_fetch:
        checked = fetched_model(checked)
    settings, dims = checked.settings, checked.dims
    config = copy.deepcopy(checked.model_config)  # sized to the tokenizer here, never in place
    tokenizer_dir, found = _tokenizer_dir(settings, checked, config)
    _refuse(found)
    data, found = prepare_run_data(settings, checked.source, tokenizer_dir, dims)
    _refuse(found)
    if note := random_model_note(settings, checked):
        say(note)
    digest, source = data.tokenizer_digest, checked.source
    cuts = layout_cuts(dims.tp, dims.ep, dims.ep_shard, settings.moe.shard_experts)
    info, shapes = run_info(settings, config, digest, source, dims.dp, recipe, cuts)
    lock, resume_from, run_id = _claim_output_dir(settings, checked, info, shapes)
    settled = {field.name: getattr(checked, field.name) for field in fields(Settled)}
    plan = RunPlan(
        **settled,
        model=model_spec(settings, config, checked.model_path),
        tokenizer_dir=Path(tokenizer_dir),
        data=data,
        pad_multiple=dims.pad_multiple(fp8=settings.train.precision == "fp8"),
        resume_from=resume_from,
        run_id=run_id,
        run_info=info,
    )
    return plan, lock


def fetched_model(checked: Checked) -> Checked:
    """The model's folder downloaded from the Hub or converted (SmolLM2), the checks' effect, and
    then checked as a folder at hand is (``recipes/checks.py``)."""
    _refuse(fetch_problems(model_choice(checked.settings)))
    model = model_problems(checked.settings, checked.dims, checked.device_type)
    _refuse(model.problems)
    return replace(
        checked,
        model_path=model.path,
        model_config=model.config,
        model_awaits_fetch=False,
        model_facts=model.facts,
    )


def fetch_problems(choice: ModelChoice, section: str = "model") -> list[Problem]:
    """The folder of ``choice`` (the ``section`` group's: ``model``, distillation's ``teacher``)
    downloaded from the Hub or converted (SmolLM2): nothing, or the one line saying why not."""
    try:
        fetch_model_folder(choice, key=f"{section}.pretrained_path")
    except (ValueError, OSError, RuntimeError) as error:
        return [Problem(key=section, message=str(error))]
    return []


def _refuse(found: list[Problem]) -> None:
    if found:
        raise ConfigError(found)


def _tokenizer_dir(
    settings: Config, checked: Checked, config: Any
) -> tuple[Path | None, list[Problem]]:
    """The model's tokenizer folder, or one trained on the data, whose vocabulary then sizes the
    model's ``config`` (and is checked against the TP plan)."""
    model_path, dims = checked.model_path, checked.dims
    try:
        tokenizer_dir = model_path or cached_tokenizer(
            checked.source, Path(settings.cache_dir).expanduser().absolute()
        )
    except DataError as error:
        return None, [Problem(key="data", message=f"data: {error}")]
    if model_path is None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
        try:
            config.vocab_size = vocab_size_for(settings.model.config["vocab_size"], len(tokenizer))
        except ValueError as error:
            return None, [Problem(key="model.config.vocab_size", message=str(error))]
        if dims.tp > 1:  # the vocabulary the TP plan splits is the tokenizer's now
            model = settings.model
            moe = moe_patterns(config, model.experts, model.routers)
            meta, sp = meta_causal_lm(config), settings.sp
            plan_found = checked_plan(config, meta, dims.tp, sp, moe)[1]
            return tokenizer_dir, plan_found + tp_problems(config, dims.tp)
    return tokenizer_dir, []


def random_model_note(settings: Config, checked: Checked) -> str | None:
    """The ``note:`` line of a user's data on a model built from its config (``model=llama``, the
    default): random weights, so the run trains from scratch, not a fine-tune; None otherwise."""
    if checked.model_path is not None or isinstance(
        checked.source, GeneratedSource | EmbeddedPreferenceSource
    ):
        return None
    return (
        f"note: model={settings.model.name} is built from its config with random weights (a tiny "
        "model for trying layouts): this trains it from scratch on your data; to fine-tune a "
        "pretrained model use model=smollm2 or model=pretrained model.pretrained_path=FOLDER_OR_ID"
    )


def streams_of(split: StreamedSplit | StreamedMixSplit) -> tuple:
    """The streamed sources a streamed split reads: its one, or a mixture's."""
    return split.sources if isinstance(split, StreamedMixSplit) else (split.source,)


def prepare_run_data(
    settings: Config, source: DataSource | MixSource, tokenizer_dir: Path, dims: ParallelDims
) -> tuple[PreparedData | None, list[Problem]]:
    """Tokenize once (or reuse the cache) and check the splits."""
    train, cache = settings.train, Path(settings.cache_dir).expanduser().absolute()
    try:
        prepared = prepare_data(
            source,
            tokenizer_dir,
            seq_len=train.seq_len,
            loss_on=settings.data.loss_on,
            packing=train.packing,
            seed=settings.seed,
            cache_root=cache,
            num_proc=max(1, min(8, os.cpu_count() or 1)),
        )
        if isinstance(prepared.train, StreamedSplit | StreamedMixSplit):
            check_dp_parts(streams_of(prepared.train), dims.dp)
    except (DataError, ValueError) as error:
        return None, [Problem(key="data", message=f"data: {error}")]
    if isinstance(prepared.train, StreamedSplit | StreamedMixSplit):  # no validation held out
        say(f"data: {prepared.folder}: tokenized and packed as it is read")
        return prepared, []
    val_rows = prepared.val.num_rows if prepared.val is not None else 0
    if train.val_every and (why := _too_few_val_rows(prepared, source, val_rows, dims.dp)):
        too_few = (
            f"train.val_every={train.val_every} needs validation rows for each of dp ({dims.dp}) "
            f"ranks but {why}: raise data.val_fraction or set train.val_every=0"
        )
        return None, [Problem(key="train.val_every", message=too_few)]
    if prepared.repaired:
        say(f"warning: {prepared.repaired}: made again from the data", file=sys.stderr)
    how = "reused from the cache" if prepared.reused else "written to the cache"
    rows = f"{prepared.train.num_rows} training rows, {val_rows} validation rows"
    say(f"data: tokenized data {how}: {prepared.folder} ({rows})")
    return prepared, []


def _too_few_val_rows(
    prepared: PreparedData, source: DataSource | MixSource, val_rows: int, dp: int
) -> str | None:
    """What holds out fewer validation rows than ``dp`` (the data, or a mixture's source), or
    None."""
    if val_rows < dp:
        return f"data.val_fraction={show(source.val_fraction)} holds out {val_rows} validation rows"
    few = [f"{name} ({s.num_rows})" for name, s in prepared.val_sources.items() if s.num_rows < dp]
    return f"data.sources {', '.join(few)} hold out fewer validation rows" if few else None


def model_spec(settings: Config, config, weights: Path | None) -> ModelSpec:
    model, train = settings.model, settings.train
    # model.experts or model.routers null: the family's patterns
    experts, routers = moe_patterns(config, model.experts, model.routers)
    return ModelSpec(
        config=config,
        weights=weights,
        seed=settings.seed,
        sequence_parallel=settings.sp,
        experts=experts,
        routers=routers,
        precision=train.precision,
        activation_checkpointing=train.activation_checkpointing,
        compile=train.compile,
        shard_experts=settings.moe.shard_experts,
        pp_stages_per_rank=settings.pp_stages_per_rank,
        nf4_base=settings.peft.name == "qlora",
        cpu_offload=train.cpu_offload,
    )


def _claim_output_dir(
    settings: Config, checked: Checked, info: dict[str, Any], shapes: dict[str, tuple[int, ...]]
) -> tuple[OutputDirLock | None, Path | None, str | None]:
    """(lock, checkpoint to resume from, run id): this process owns the output folder (locks it,
    writes its run.json and config.yaml, resumes from it); a dry run only chooses the checkpoint.
    The last step that can refuse the run: nothing after it leaves a claimed folder behind."""
    output = checked.output_dir
    try:
        if not settings.dry_run:
            claim = (settings, output, info, shapes, checked.config_yaml)
            lock, resume_from, record = own_output_dir(*claim)
            return lock, resume_from, record.run_id
        resume, max_steps = settings.checkpoint.resume, settings.train.max_steps
        checkpoints = output / "checkpoints"
        return None, choose_checkpoint(resume, max_steps, checkpoints, info, shapes), None
    except OwnershipError as error:
        raise ConfigError([error.problem()]) from None


def resume_again(plan: RunPlan, attempt: int) -> RunPlan:
    """A restarted local rank's plan: the checkpoint chosen again, the last complete one."""
    resume, max_steps = plan.checkpoint.resume, plan.train.max_steps
    where = (resume, max_steps, plan.checkpoints, plan.run_info)
    resume_from = choose_checkpoint(*where, shapes=None)  # the same model as before
    at = f"from {resume_from}" if resume_from is not None else "from step 0"
    say(f"note: restart {attempt} of {plan.settings.max_restarts} after a rank failed: {at}")
    return replace(plan, resume_from=resume_from)
