"""Whose folder, and which checkpoint: decided once in the launching process, under the folder's
lock.

- The lock (``output_dir/.lock``) is taken before anything is written there and held until the
  launcher exits.
- The checkpoint to resume from: ``auto`` takes the newest usable one, passing over damaged ones out
  loud; an explicit path must be a complete, undamaged checkpoint. Either must match this run (model
  shapes, optimizer, batch geometry) and leave steps to train.
- The folder's files then belong to this run: a fresh run never adopts, prunes or overwrites another
  run's files (``overwrite_output_dir=true`` replaces them, and only them).
"""

import errno
import json
from pathlib import Path
from typing import Any

from components.checkpoint.integrity import (
    CheckpointError,
    CheckpointSummary,
    check_checkpoint,
    checkpoint_summary,
    complete_checkpoints,
    find_resumable,
    model_fingerprint,
    resume_problems,
    retire_checkpoints_after,
    state_dict_shapes,
)
from components.data.sources import DataSource, MixSource
from components.data.stream_mixture import is_streamed
from components.data.streaming import StreamedSource
from components.models import meta_causal_lm
from components.models.lora import PROJECTIONS
from components.problems import Problem, show
from components.runtime.exit_status import AlreadyComplete, disk_full
from components.runtime.output_dir import (
    RUN_FILE,
    OutputDirError,
    OutputDirLock,
    RunRecord,
    claim_output_dir,
    config_hash,
    lock_output_dir,
    read_run_record,
    remove_run_files,
    run_files,
    write_whole,
)
from components.runtime.problems import say
from components.training.metrics import last_logged_step
from recipes.export import exported_folders
from recipes.resume_record import FROZEN, RecipeRecord, frozen_problems
from recipes.schema import Config


class OwnershipError(ValueError):
    """The folder or the checkpoint cannot be used, while claiming it under the lock; the message is
    one line saying why and what to do, ``key`` the setting (its :class:`Problem`'s key)."""

    def __init__(self, message: str, key: str = "output_dir") -> None:
        super().__init__(message)
        self.key = key

    def problem(self) -> Problem:
        return Problem(key=self.key, message=str(self))


def run_info(
    settings: Config,
    model_config,
    tokenizer_digest: str,
    source: DataSource | MixSource | StreamedSource | None = None,
    dp: int = 1,
    recipe: RecipeRecord | None = None,
    cuts: dict[str, int] | None = None,
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """What a checkpoint of this run records, and what a resume must match (tp, dp and ep may
    change); and the model's tensor shapes, which that record holds as a fingerprint (hand them to
    :func:`choose_checkpoint`, so a resume that differs names the tensor). The tokenizer's digest is
    part of it: a model built from its config gets a tokenizer trained on the data, whose ids change
    with the data (``data.num_examples``, ``seed``, an edited file) at the same vocabulary size. So
    are the data (``source``: which, and its fingerprint), ``seed`` (the data order) and
    ``data.val_fraction`` (the split) and ``data.loss_on`` (the labels): a resume that changes them
    trains on another timeline's data, or validates on records it trained on. A streamed source's
    (or mixture's) ``dp`` too: each dp rank's position in the stream is its own
    (components/data/streaming.py). A ``recipe``'s frozen models and loss settings
    (:class:`RecipeRecord`) join them, and the layout's ``cuts`` (:func:`layout_cuts`)."""
    shapes = state_dict_shapes(meta_causal_lm(model_config))
    recipe = recipe or RecipeRecord()
    data = {}
    if source is not None:
        path = getattr(source, "path", None)
        origin = f"data.path={path}" if path else "data=generated"
        splits = {}
        if isinstance(source, MixSource):  # and each source's split of its records
            origin = "data=mix: " + ", ".join(f"{p.name} {p.weight!r}" for p in source.parts)
            splits = {MIX_SPLITS: {part.name: part.source.val_fraction for part in source.parts}}
        data = {"data": {"source": origin, "fingerprint": source.fingerprint()}, **splits}
    info = {
        "recipe": settings.RECIPE,  # another recipe's run is another objective
        "model": model_fingerprint(shapes),
        "tokenizer": tokenizer_digest,
        "optimizer": settings.optim.target,
        "global_batch_size": settings.train.global_batch_size,
        "seq_len": settings.train.seq_len,
        "packing": settings.train.packing,
        "seed": settings.seed,
        "peft": peft_info(settings.peft),  # adapters change the model and the optimizer state
        "data.val_fraction": settings.data.model_dump().get("val_fraction"),
        "data.loss_on": settings.data.loss_on,  # which tokens are trained
        **data,
        **({STREAM_DP: dp} if is_streamed(source) else {}),
        **({FROZEN: recipe.frozen} if recipe.frozen else {}),
        **({CUTS: cuts} if cuts else {}),
        SETTINGS: resume_settings(settings) | _as_json(recipe.settings),
    }
    return info, shapes


def peft_info(peft) -> dict:
    """``peft``'s settings as a checkpoint records them: ``target_modules=null`` as the patterns it
    stands for, which the checkpoints of runs before null was the default recorded."""
    info = peft.model_dump()
    if peft.adapters and info["target_modules"] is None:
        info["target_modules"] = list(PROJECTIONS)
    return info


STREAM_DP = "dp (a stream resumes at the dp it was read at)"  # the run_info key of a stream's dp
MIX_SPLITS = "data.sources' val_fraction"  # the run_info key of a mixture's sources' splits
SETTINGS = "settings"  # the run_info key of what a resume may change (not matched by resume)
_UNSET = "unset"  # a setting one side does not give
CUTS = "cuts past the first dim"  # the run_info key of layout_cuts (not matched by resume)
# torchao's optimizers whose quantized state DCP reshards along its first dimension only
# (torchao's subclass_8bit.py and subclass_4bit.py: "Only support aten.slice along the first dim")
_FIRST_DIM_ONLY = {"torchao.optim.AdamW8bit": "8-bit", "torchao.optim.AdamW4bit": "4-bit"}
# optimizer options whose change a resume refuses: the state they need is not in the checkpoint
_FIXED_OPTIONS = {"amsgrad": "AdamW's max_exp_avg_sq state is kept only with amsgrad=true"}


def resume_settings(settings: Config) -> dict[str, Any]:
    """What a resume applies from its step on when it differs from the checkpoint's run: the
    optimizer's options, the schedule, warmup, run length, clipping and precision (JSON's
    values)."""
    schedule, train = settings.schedule, settings.train
    found = {f"optim.{key}": value for key, value in settings.optim.options().items()}
    found |= {"schedule": schedule.name}
    found |= {f"schedule.{key}": value for key, value in schedule.options().items()}
    found |= {"train.warmup_steps": train.warmup_steps, "train.max_steps": train.max_steps}
    found |= {"train.clip_grad_norm": train.clip_grad_norm, "train.precision": train.precision}
    return _as_json(found)


def _as_json(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as JSON reads them back (a checkpoint's record compares equal)."""
    return json.loads(json.dumps(values, default=str))


def layout_cuts(tp: int, ep: int, ep_shard: int, shard_experts: bool) -> dict[str, int]:
    """The degrees that cut a weight past its first dimension: ``tp`` (row-parallel layers split
    their input dimension), and ``ep_shard`` when ``moe.shard_experts`` splits each expert's rows
    over its copies (dim 1; ``components/moe/expert_parallel.py``). FSDP (dp, cp), ep (the experts'
    own dimension) and pp (whole tensors) cut along the first dimension or not at all."""
    return {"tp": tp, "ep_shard": ep_shard if shard_experts and ep > 1 else 1}


def _cut_problems(recorded: Any, now: dict[str, int], optimizer: str) -> list[str]:
    """Why a quantized optimizer state cut as ``recorded`` cannot load cut as ``now`` (nothing
    for other optimizers, or a checkpoint written before the record)."""
    bits = _FIRST_DIM_ONLY.get(optimizer)
    if bits is None or not isinstance(recorded, dict):
        return []
    changed = [(key, then) for key, then in recorded.items() if now.get(key, then) != then]
    changed = [(key, then) for key, then in changed if key in _CUT_WHY]  # a later record's keys
    return [
        f"{key} {then} -> {now[key]}: {optimizer}'s {bits} state reshards along its first "
        f"dimension only (torchao), and {_CUT_WHY[key]}: resume with {_CUT_FIX[key]}{then} "
        "(a dp, cp, pp or ep that keeps it works)"
        for key, then in changed
    ]


_CUT_WHY = {  # what each of layout_cuts' degrees cuts past the first dimension
    "tp": "tp splits the row-parallel layers along their second",
    "ep_shard": "moe.shard_experts=true splits each expert's rows over its ep_shard copies",
}
_CUT_FIX = {"tp": "tp=", "ep_shard": "ep_shard = world size / ep = "}


def changed_settings(recorded: Any, now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (then, now)}`` for each resume setting that differs from the checkpoint's record
    (``recorded``; nothing for a checkpoint written before the record)."""
    if not isinstance(recorded, dict):
        return {}
    keys = sorted(set(recorded) | set(now))
    pairs = {key: (recorded.get(key, _UNSET), now.get(key, _UNSET)) for key in keys}
    return {key: pair for key, pair in pairs.items() if pair[0] != pair[1]}


def _refuse_fixed_settings(changes: dict[str, tuple[Any, Any]], path: Path) -> None:
    """Raise OwnershipError naming the first changed setting a resume cannot apply."""
    for key, (then, now) in changes.items():
        if (option := key.removeprefix("optim.")) in _FIXED_OPTIONS:
            keep = f"drop {key}" if then == _UNSET else f"keep {key}={then}"
            why = (
                f"cannot resume from {path}: {key} is {now!r} but the checkpoint was written with "
                f"{then!r} ({_FIXED_OPTIONS[option]}); {keep} to resume"
            )
            raise OwnershipError(why, key)


def changes_note(step: int, changes: dict[str, tuple[Any, Any]]) -> str:
    """The ``note:`` line of a resume with changed settings (applied from step ``step`` + 1)."""
    listed = ", ".join(f"{key} {then} -> {now}" for key, (then, now) in changes.items())
    return (
        f"note: resuming from step {step} with changed settings, applied from step {step + 1} on: "
        f"{listed}"
    )


def choose_checkpoint(
    resume: str | None,
    max_steps: int,
    checkpoints: Path,
    info: dict[str, Any],
    shapes: dict[str, tuple[int, ...]] | None,
) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``auto``: the latest complete one in
    ``checkpoints``), or None; raise OwnershipError when the asked-for one cannot be used by a run
    of ``max_steps`` recording ``info``. ``shapes`` (:func:`run_info`'s), when given, name the
    first tensor of a model that differs."""
    if resume is None:
        return None
    try:
        if resume == "auto":
            choice = find_resumable(checkpoints)
            for folder, cause in choice.skipped:
                say(f"warning: skipping checkpoint {folder}: {cause}")
            if choice.path is None:
                return None
            summary = check_checkpoint(choice.path)
        else:
            summary = check_checkpoint(Path(resume).expanduser().absolute())
    except CheckpointError as error:
        why = f"checkpoint.resume={show(resume)}: {error}"
        raise OwnershipError(why, "checkpoint.resume") from None
    if mismatches := _mismatches(summary, info, max_steps, shapes):
        why = f"cannot resume from {summary.path}: {'; '.join(mismatches)}"
        raise OwnershipError(why, "checkpoint.resume")
    changes = changed_settings(summary.run_info.get(SETTINGS), info[SETTINGS])
    _refuse_fixed_settings(changes, summary.path)
    return summary.path


def _mismatches(
    summary: CheckpointSummary,
    info: dict[str, Any],
    max_steps: int,
    shapes: dict[str, tuple[int, ...]] | None,
) -> list[str]:
    """Why a run recording ``info`` cannot resume the checkpoint ``summary`` describes: what it
    records differently (:func:`resume_problems`; its frozen models by their weights; a
    quantized optimizer state's cuts), or no steps left before ``max_steps``."""
    matched = {key: value for key, value in info.items() if key not in (SETTINGS, FROZEN, CUTS)}
    found = resume_problems(summary, matched, max_steps, shapes)
    found += _cut_problems(summary.run_info.get(CUTS), info.get(CUTS, {}), info["optimizer"])
    return found + frozen_problems(summary.run_info.get(FROZEN), info.get(FROZEN, {}))


def finished(
    settings: Config, output_dir: Path, info: dict[str, Any], shapes: dict[str, tuple[int, ...]]
) -> bool:
    """Whether ``checkpoint.resume=auto`` finds this run (``info``) already done in ``output_dir``:
    its newest usable checkpoint is at ``train.max_steps``, matches this run in everything else a
    resume matches, and the export the run writes is there (``checkpoint.export``). A run that
    saves no checkpoints (``every_steps=0``): the folder's ``run.json`` records this very config,
    whose metrics reached ``train.max_steps``, and the export is there."""
    if settings.checkpoint.resume != "auto":
        return False
    try:
        newest = find_resumable(output_dir / "checkpoints").path
        summary = check_checkpoint(newest) if newest is not None else None
    except CheckpointError:
        return False  # choose_checkpoint says why
    exports = exported_folders(settings.peft) if settings.checkpoint.export else ()
    exported = all((output_dir / folder).is_dir() for folder in exports)
    if summary is None:
        return exported and _ended_without_checkpoints(settings, output_dir)
    if summary.step != settings.train.max_steps:
        return False
    beyond = summary.step + 1  # a run length that leaves steps: only the rest is judged here
    return exported and not _mismatches(summary, info, beyond, shapes)


def _ended_without_checkpoints(settings: Config, output_dir: Path) -> bool:
    """Whether the folder's run is this config's (its ``run.json``), saved no checkpoint and
    logged ``train.max_steps``."""
    digest = config_hash(settings.model_dump(by_alias=True))
    return _checkpointless_attempt(output_dir, digest) and _logged_to_the_end(settings, output_dir)


def _checkpointless_attempt(output_dir: Path, digest: str) -> bool:
    """Whether ``output_dir`` holds an attempt of this very config (its ``run.json`` records
    ``digest``) that left no complete checkpoint."""
    previous = read_run_record(output_dir)
    found = previous is not None and previous.config_hash == digest
    return found and not has_a_checkpoint(output_dir)


def _logged_to_the_end(settings: Config, output_dir: Path) -> bool:
    """Whether the folder's ``metrics.jsonl`` reached ``train.max_steps``."""
    return last_logged_step(output_dir / "metrics.jsonl") >= settings.train.max_steps


def own_output_dir(
    settings: Config,
    output_dir: Path,
    info: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    config_yaml: str,
) -> tuple[OutputDirLock, Path | None, RunRecord]:
    """Lock ``output_dir``, choose the checkpoint to resume from and claim the folder for this run
    (its ``run.json`` and ``config.yaml``). Refused, or on a disk too full to claim it, nothing of
    this run is left there: no lock, no private copies, no ``run.json`` of a fresh run."""
    try:
        lock = lock_output_dir(output_dir)
    except OutputDirError as error:
        raise OwnershipError(str(error)) from None
    resume_from = None
    try:
        resume, max_steps = settings.checkpoint.resume, settings.train.max_steps
        if finished(settings, output_dir, info, shapes):
            raise AlreadyComplete(
                f"checkpoint.resume=auto: the run in {output_dir} is already complete at step "
                f"{max_steps}: nothing to train (a larger train.max_steps trains on)"
            )
        resume_from = choose_checkpoint(resume, max_steps, output_dir / "checkpoints", info, shapes)
        if resume_from is not None and settings.checkpoint.resume != "auto":
            _check_foreign_resume(output_dir, resume_from, settings.overwrite_output_dir)
        record = _claim(settings, output_dir, resume_from, config_yaml)
    except AlreadyComplete:
        lock.release()
        raise
    except (OutputDirError, OwnershipError) as error:
        lock.release()  # refused: no .lock is left in the folder
        raise (OwnershipError(str(error)) if isinstance(error, OutputDirError) else error) from None
    except OSError as error:  # a full disk: said plainly, no traceback
        lock.release()
        raise OwnershipError(_unwritable(error, output_dir, resume_from)) from None
    if resume_from is not None:  # nothing refuses the run after the claim: the old branch moves
        summary = checkpoint_summary(resume_from)
        step = summary.step
        if changes := changed_settings(summary.run_info.get(SETTINGS), info[SETTINGS]):
            say(changes_note(step, changes))
        if retired := retire_checkpoints_after(output_dir / "checkpoints", step):
            names = ", ".join(path.name for path in retired)
            say(
                f"note: resuming from step {step}: the later checkpoints of the branch it leaves "
                f"are moved aside ({names}), so checkpoint.resume=auto never returns to them"
            )
    return lock, resume_from, record


def _claim(
    settings: Config, output_dir: Path, resume_from: Path | None, config_yaml: str
) -> RunRecord:
    """``run.json`` and ``config.yaml`` of this run; a fresh claim that cannot write them takes its
    ``run.json`` back, so the folder holds no run of this one. An earlier attempt of this run that
    left no checkpoint (:func:`starts_again`) is replaced, with a ``note:``."""
    digest = config_hash(settings.model_dump(by_alias=True))
    again = resume_from is None and starts_again(settings, output_dir, digest)
    replaced = run_files(output_dir) if again else []
    record = claim_output_dir(
        output_dir,
        digest,
        continuing=resume_from is not None,
        overwrite=settings.overwrite_output_dir or again,
        resumable=settings.checkpoint.resume is None and has_a_checkpoint(output_dir),
    )
    try:
        write_whole(output_dir / "config.yaml", config_yaml)
    except OSError:
        if resume_from is None:
            (output_dir / RUN_FILE).unlink(missing_ok=True)
        raise
    if again:
        say(
            f"note: checkpoint.resume=auto: {output_dir} holds an earlier attempt of this run (its "
            f"{RUN_FILE} records the same config) that stopped before its first checkpoint: "
            f"starting again from step 0, its files ({', '.join(replaced)}) replaced"
        )
    return record


def starts_again(settings: Config, output_dir: Path, digest: str) -> bool:
    """Whether ``checkpoint.resume=auto``, finding no checkpoint, starts the folder's run again
    from step 0: its ``run.json`` records this config (``digest``: an earlier attempt of the same
    command, killed hard before its first checkpoint, as a requeued job finds it) and that attempt
    neither left a checkpoint nor reached its last step or its export. Another config's files stay
    refused."""
    if settings.checkpoint.resume != "auto" or not _checkpointless_attempt(output_dir, digest):
        return False
    exported = any((output_dir / folder).exists() for folder in exported_folders(settings.peft))
    return not exported and not _logged_to_the_end(settings, output_dir)


def has_a_checkpoint(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds a complete checkpoint a resume could continue from (a run
    stopped before its first save holds none: then a refusal does not advise a resume)."""
    return bool(complete_checkpoints(output_dir / "checkpoints"))


def _unwritable(error: OSError, output_dir: Path, resume_from: Path | None) -> str:
    """Why ``output_dir`` could not be claimed, and what to do: on a full disk the space left and
    (resuming) the checkpoint that is kept."""
    if resume_from is not None and (full := disk_full(error, output_dir)):
        return full
    cause = f"no space left on device in {output_dir}" if error.errno == errno.ENOSPC else None
    cause = cause or f"output_dir {output_dir} cannot be written ({error.strerror or error})"
    return (
        f"{cause}: nothing was claimed or trained; free space (or fix it) and run again, or "
        "choose an output_dir on another disk"
    )


def _check_foreign_resume(output_dir: Path, checkpoint: Path, overwrite: bool) -> None:
    """An explicit checkpoint of another run than the one ``output_dir`` holds would continue inside
    that run's folder, cutting its metrics back and replacing its checkpoints: refuse, or with
    ``overwrite_output_dir`` (and the checkpoint elsewhere) remove that run's files first, so the
    resumed run starts the folder afresh."""
    held = read_run_record(output_dir)
    theirs = checkpoint_summary(checkpoint).run_id
    if held is None or not run_files(output_dir) or held.run_id == theirs:
        return
    if overwrite and not checkpoint.is_relative_to(output_dir):
        remove_run_files(output_dir, held)
        return
    raise OutputDirError(
        f"output_dir {output_dir} holds another run's files than the one "
        f"checkpoint.resume={checkpoint} belongs to; "
        "resuming there would mix the two runs: choose another output_dir=..."
        + ("" if overwrite else ", or set overwrite_output_dir=true to replace that folder's run")
    )
