"""Everything checked and prepared once, in the launching process, before any rank starts.

Every problem becomes part of one ``error:`` line on stderr (problems joined by "; ", each naming the key,
its value and what would work) and exit status 2, in seconds: no traceback wall, no rank left waiting.

Checks, in order: Hydra composition (unknown group option, misspelt key, bad override syntax);
interpolations; every key's type and range (:data:`RULES`); optimizer name and options; sizes that do not
factor the world; batch sizes that do not divide; ``checkpoint.resume`` (auto, null or a complete
checkpoint folder); ``output_dir`` (a folder that can be created and written); model path, plan
divisibility (heads, kv heads, intermediate size by tp) and expert parallelism; the data file (exists,
every line valid, at least one record), the validation split; and, once the tokenizer exists, that every
record keeps answer tokens within ``train.seq_len``.

:func:`compose_config` runs all but the last check before ``hydra.main`` starts (Hydra would otherwise
create ``output_dir`` first, with a traceback if it is a file); :func:`prepare` runs them again inside it
(cheap: well under a second for the embedded data) and then prepares the tokenizer.
"""

import inspect
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.data import (
    DEFAULT_VOCAB_SIZE,
    DataError,
    generate_examples,
    read_jsonl,
    split_train_val,
    tokenize_records,
    train_tokenizer,
    training_texts,
)
from components.distributed.launch import started_by_launcher
from components.distributed.mesh import ParallelDims, resolve_parallel_dims
from components.distributed.tp_plan import check_plan, plan_for
from components.models import load_config, meta_causal_lm, tiny_config
from components.models.configs import FAMILIES
from components.moe import check_expert_parallel
from components.training.checkpoint import MARKER, latest_checkpoint
from components.training.faults import parse_fault

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# optim.name -> the optimizer class its config group instantiates.
OPTIMIZERS = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what to change."""


@dataclass(frozen=True)
class Prepared:
    """What the ranks need beyond the config: sizes, the device, and resolved paths."""

    dims: ParallelDims
    device_type: str
    model_path: str | None  # a Hugging Face folder to load; None builds the tiny config
    tokenizer_dir: str


@dataclass(frozen=True)
class Checked:
    """What :func:`check_config` worked out on the way: reused by :func:`prepare`."""

    dims: ParallelDims
    device_type: str
    model_path: str | None
    records: list[dict]


def fail(message: str) -> None:
    """Print one ``error:`` line (the first paragraph of the message) and exit 2."""
    first = message.strip().split("\n\n")[0].replace("\n", " ")
    print(f"error: {first}", file=sys.stderr)
    sys.exit(2)


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose like ``hydra.main`` would and check the result, so composition errors and bad settings print
    as one ``error:`` line before Hydra creates ``output_dir`` or any rank starts."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        fail(str(error))
    try:
        check_config(cfg)
    except ConfigError as error:
        fail(str(error))
    return cfg


# --- every key's type and range ------------------------------------------------------------------


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: _integer(value) and value >= low


def _or_null(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _text(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str | type(None)) and value in choices


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(_text(item) for item in value)


# key -> (accepts the value, what would work). Keys absent from the config (an optimizer's own options)
# are skipped; a key set to ??? must be given.
def _is_fault(value: Any) -> bool:
    try:
        return parse_fault(value) is not None
    except ValueError:
        return False


RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (_integer, "an integer, e.g. seed=0"),
    "tp": (_int_at_least(1), "a positive integer, e.g. tp=2"),
    "dp": (_or_null(_int_at_least(1)), "null (world size / tp) or a positive integer, e.g. dp=2"),
    "sp": (lambda value: isinstance(value, bool), "true or false"),
    "ep": (_int_at_least(1), "a positive integer, e.g. ep=2"),
    "nproc": (_or_null(_int_at_least(1)), "null (dp × tp) or a positive integer, e.g. nproc=4"),
    "output_dir": (_text, "a folder path, e.g. output_dir=outputs/run1"),
    "train.max_steps": (_int_at_least(1), "a positive integer, e.g. train.max_steps=60"),
    "train.stop_after": (_or_null(_int_at_least(1)), "null or a positive step number, e.g. train.stop_after=20"),
    "train.global_batch_size": (_int_at_least(1), "a positive integer, e.g. train.global_batch_size=16"),
    "train.micro_batch_size": (_int_at_least(1), "a positive integer, e.g. train.micro_batch_size=8"),
    "train.seq_len": (_int_at_least(2), "an integer of at least 2, e.g. train.seq_len=48"),
    "train.clip_grad_norm": (
        _or_null(lambda value: _number(value) and value > 0),
        "null (no clipping) or a positive number, e.g. train.clip_grad_norm=1.0",
    ),
    "train.val_every": (_int_at_least(0), "0 (never) or a positive number of steps, e.g. train.val_every=20"),
    "train.warmup_steps": (_int_at_least(0), "0 or a positive number of steps, e.g. train.warmup_steps=5"),
    "train.min_lr_ratio": (lambda value: _number(value) and 0 <= value <= 1, "a number in [0, 1], e.g. 0.1"),
    "train.on_nonfinite": (_one_of("stop", "skip"), "stop or skip"),
    "debug.check_replicas_every": (_int_at_least(0), "0 (off) or a positive number of steps, e.g. 10"),
    "debug.fault": (_or_null(_is_fault), "null, nan_grad@STEP, perturb_replica@STEP, raise@STEP or replica_sync_sum"),
    "checkpoint.every_steps": (_int_at_least(0), "0 (off) or a positive number of steps, e.g. 20"),
    "checkpoint.resume": (_or_null(_text), "auto, null or the path of a checkpoint folder"),
    "checkpoint.keep": (_or_null(_int_at_least(1)), "null (keep all) or a positive integer, e.g. 2"),
    "checkpoint.export": (lambda value: isinstance(value, bool), "true or false"),
    "data.name": (_one_of("default", "jsonl"), "default or jsonl (pick the group: data=jsonl)"),
    "data.path": (_or_null(_text), "the path of a JSONL file"),
    "data.num_examples": (_or_null(_int_at_least(1)), "null (all) or a positive integer, e.g. 400"),
    "data.val_fraction": (lambda value: _number(value) and 0 <= value < 1, "a number in [0, 1), e.g. 0.05"),
    "model.name": (_text, "a name, e.g. model.name=llama"),
    "model.family": (_or_null(_one_of(*FAMILIES)), f"null or one of {', '.join(sorted(FAMILIES))}"),
    "model.pretrained_path": (_or_null(_text), "null or a local Hugging Face model folder"),
    "model.source": (_one_of(None, "smollm2"), "null or smollm2"),
    "model.experts": (_strings, "a list of module patterns, e.g. [model.layers.*.mlp.experts]"),
    "model.routers": (_strings, "a list of module patterns, e.g. [model.layers.*.mlp.gate]"),
    "optim.name": (_one_of(*OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)} (pick the group: optim=sgd)"),
    "optim.lr": (lambda value: _number(value) and value > 0, "a positive number, e.g. optim.lr=3e-3"),
    "optim.weight_decay": (lambda value: _number(value) and value >= 0, "0 or a positive number"),
    "optim.momentum": (lambda value: _number(value) and 0 <= value < 1, "a number in [0, 1), e.g. 0.9"),
    "optim.betas": (
        lambda value: isinstance(value, list) and len(value) == 2 and all(_number(b) and 0 <= b < 1 for b in value),
        "two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]",
    ),
}
REQUIRED = set(RULES) - {"optim.weight_decay", "optim.momentum", "optim.betas"}
_ABSENT = object()
_MISSING = object()


def show(value: Any) -> str:
    """A value as a Hydra override would spell it (null, true, 'text', [1, 2])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _lookup(cfg: DictConfig, key: str) -> Any:
    """The plain value at the dotted ``key``; ``_ABSENT`` when there is none, ``_MISSING`` when it is ???."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return _ABSENT
    if OmegaConf.is_missing(parent, leaf):
        return _MISSING
    if leaf not in parent:
        return _ABSENT
    value = parent[leaf]
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def check_types(cfg: DictConfig) -> list[str]:
    """Every key of :data:`RULES` with a value of the wrong type or out of range, and the optimizer's options."""
    errors = []
    for key, (accepts, what) in RULES.items():
        value = _lookup(cfg, key)
        if value is _MISSING:
            if key == "data.path":
                errors.append("data.path is not set: data=jsonl needs data.path=/path/to/file.jsonl")
            else:
                errors.append(f"{key} is not set (???): give {what}")
        elif value is _ABSENT:
            if key in REQUIRED:
                errors.append(f"{key} is missing from the config: add it back with +{key}=..., {what}")
        elif not accepts(value):
            errors.append(f"{key}={show(value)} is not valid: use {what}")
    return errors + check_optimizer(cfg)


def check_optimizer(cfg: DictConfig) -> list[str]:
    """``optim.name`` matches the class the group instantiates, and every other key is one of its options."""
    name, target = _lookup(cfg, "optim.name"), _lookup(cfg, "optim._target_")
    if name not in OPTIMIZERS:
        return []  # reported by check_types
    if target != OPTIMIZERS[name]:
        return [
            f"optim.name={show(name)} does not match optim._target_={show(target)}: choose the optimizer with "
            f"the group (optim={name}), not with optim.name"
        ]
    accepted = set(inspect.signature(get_class(target)).parameters) - {"params"}
    unknown = sorted(set(cfg.optim) - accepted - {"name", "_target_"})
    if unknown:
        options = ", ".join(sorted(accepted))
        return [f"optim.{key} is not an option of {target}; its options: {options}" for key in unknown]
    return []


# --- sizes, paths and data -----------------------------------------------------------------------


def world_size_for(cfg: DictConfig, device_type: str) -> int:
    if started_by_launcher():
        return int(os.environ["WORLD_SIZE"])
    if cfg.nproc is not None:
        return cfg.nproc
    return torch.cuda.device_count() if device_type == "cuda" else (cfg.dp or 1) * cfg.tp


def model_config(cfg: DictConfig, model_path: str | None, vocab_size: int):
    if model_path is not None:
        return load_config(model_path)
    if cfg.model.family is None:
        raise ConfigError(f"model {cfg.model.name!r} needs model.pretrained_path or model.family")
    return tiny_config(cfg.model.family, vocab_size=vocab_size)


def resolve_model_path(cfg: DictConfig) -> str | None:
    if cfg.model.pretrained_path is not None:
        path = Path(cfg.model.pretrained_path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.pretrained_path {str(path)!r} is not a Hugging Face model folder (no config.json)"
            )
        return str(path)
    if cfg.model.source == "smollm2":
        from components.models.smollm2 import smollm2_folder

        return str(smollm2_folder())
    return None


def records_for(data: DictConfig, seed: int) -> list[dict]:
    """The dataset's records: generated, or read (and fully validated) from the user's JSONL file."""
    if data.name == "jsonl":
        records = read_jsonl(data.path)
    else:
        records = generate_examples(data.num_examples, seed)
    return records[: data.num_examples] if data.num_examples else records


def check_numbers(cfg: DictConfig, dims: ParallelDims) -> list[str]:
    """Batch sizes that divide over dp (types and ranges are :func:`check_types`' job)."""
    train = cfg.train
    if train.global_batch_size % (train.micro_batch_size * dims.dp):
        fits = train.micro_batch_size * dims.dp
        return [
            f"train.global_batch_size ({train.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({train.micro_batch_size}) × dp ({dims.dp}): use a multiple of {fits}, e.g. "
            f"train.global_batch_size={max(fits, train.global_batch_size // fits * fits)}"
        ]
    return []


def check_resume(resume: str | None) -> list[str]:
    """``checkpoint.resume`` is auto, null, or a complete checkpoint folder (one with the marker)."""
    if resume in (None, "auto"):
        return []
    path = Path(resume).expanduser()
    if (path / MARKER).is_file():
        return []
    if not path.is_dir():
        why = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
    elif (latest := latest_checkpoint(path)) is not None:
        return [f"checkpoint.resume={show(resume)} holds checkpoints but is not one: use checkpoint.resume={latest}"]
    elif path.name.endswith(".tmp"):
        why = "is an unfinished save (no COMPLETE marker)"
    else:
        why = f"is not a complete checkpoint (no {MARKER} marker)"
    return [f"checkpoint.resume={show(resume)} {why}: use auto, null or a step_NNNNNNNN checkpoint folder"]


def check_output_dir(output_dir: str) -> list[str]:
    """``output_dir`` is a folder, or can be created as one, and can be written."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        return [f"output_dir={show(output_dir)} is a file, not a folder: choose another output_dir"]
    existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
    if not existing.is_dir():
        return [f"output_dir={show(output_dir)} cannot be created: {existing} is a file; choose another output_dir"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"output_dir={show(output_dir)} is not writable ({existing}): choose a folder you can write to"]
    return []


def check_data(cfg: DictConfig, dims: ParallelDims | None) -> tuple[list[str], list[dict]]:
    """Read (and fully validate) the records; check the validation split. Returns (errors, records)."""
    data = cfg.data
    if data.name == "default" and data.num_examples is None:
        return ["data.num_examples=null is not valid with the generated data: use a positive integer, e.g. 4000"], []
    if data.name == "jsonl":
        if data.path is None:
            return ["data.path is not set: data=jsonl needs data.path=/path/to/file.jsonl"], []
        path = Path(data.path).expanduser()
        if not path.exists():
            return [f"data.path={show(data.path)} does not exist: give a JSONL file of prompt/response records"], []
        if not path.is_file():
            return [f"data.path={show(data.path)} is not a file: give a JSONL file of prompt/response records"], []
        if not os.access(path, os.R_OK):
            return [f"data.path={show(data.path)} is not readable: check its permissions"], []
    try:
        records = records_for(data, cfg.seed)
    except DataError as error:
        return [f"data.path: {error}"], []
    try:
        _, val = split_train_val(records, data.val_fraction, cfg.seed)
    except ValueError as error:
        return [str(error)], records
    if cfg.train.val_every and not val:
        return [
            f"train.val_every={cfg.train.val_every} needs validation records but data.val_fraction="
            f"{show(data.val_fraction)} holds none out: raise data.val_fraction or set train.val_every=0"
        ], records
    if cfg.train.val_every and dims is not None and len(val) < dims.dp:
        return [
            f"data.val_fraction={show(data.val_fraction)} holds out {len(val)} validation records, fewer than "
            f"dp ({dims.dp}): raise data.val_fraction or set train.val_every=0"
        ], records
    return [], records


def tp_hint(config, errors: list[str]) -> list[str]:
    """After a divisibility error, the tp values that would fit the model."""
    if not any(error.startswith("tp (") for error in errors):
        return errors
    sizes = [getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size")]
    sizes = [size for size in sizes if size]
    fits = [tp for tp in range(1, min(sizes) + 1) if all(size % tp == 0 for size in sizes)]
    return [*errors, f"tp values that fit this model: {', '.join(map(str, fits))}"]


def check_model(cfg: DictConfig, dims: ParallelDims | None) -> tuple[list[str], str | None]:
    """Model path, plan divisibility at this tp and expert parallelism. Returns (errors, model_path)."""
    try:
        model_path = resolve_model_path(cfg)
        config = model_config(cfg, model_path, DEFAULT_VOCAB_SIZE)
    except (ValueError, OSError, RuntimeError) as error:
        return [str(error)], None
    if dims is None:
        return [], model_path
    errors = []
    moe_modules = (*cfg.model.experts, *cfg.model.routers)
    if dims.tp > 1:
        meta = meta_causal_lm(config)
        errors += tp_hint(config, check_plan(meta, config, plan_for(config, cfg.sp), dims.tp, moe_modules)[1])
    if dims.ep > 1:
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        errors += check_expert_parallel(meta_causal_lm(config), list(cfg.model.experts), num_experts, dims.ep, dims.tp)
        if dims.dp > 1:
            errors.append(f"ep={dims.ep} with dp={dims.dp} is not supported yet: use dp=1 (ep folds onto tp)")
    return errors, model_path


def unresolvable(cfg: DictConfig, error: Exception) -> str:
    """Which key's ``${...}`` interpolation failed (OmegaConf.resolve does not say), with the reason."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    pending = [(key, value) for key, value in raw.items()]
    while pending:
        key, value = pending.pop(0)
        if isinstance(value, dict):
            pending += [(f"{key}.{child}", item) for child, item in value.items()]
            continue
        try:
            node = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            if isinstance(node, ListConfig):
                OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as failure:
            reason = str(failure).splitlines()[0]
            return f"{key}={show(value)} cannot be resolved ({reason}): fix the ${{...}} reference"
    return f"the config cannot be resolved: {str(error).splitlines()[0]}"


def check_config(cfg: DictConfig) -> Checked:
    """Every check that needs no tokenizer, all problems collected; raise ConfigError naming each one."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(unresolvable(cfg, error)) from error
    errors = check_types(cfg)
    if errors:  # the checks below rely on the types
        raise ConfigError("; ".join(errors))

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dims = resolve_parallel_dims(world_size_for(cfg, device_type), tp=cfg.tp, dp=cfg.dp, ep=cfg.ep)
    except ValueError as error:
        dims, errors = None, [str(error)]
    if dims is not None:
        errors += check_numbers(cfg, dims)
    errors += check_resume(cfg.checkpoint.resume)
    errors += check_output_dir(cfg.output_dir)
    model_errors, model_path = check_model(cfg, dims)
    data_errors, records = check_data(cfg, dims)
    errors += model_errors + data_errors
    if errors:
        raise ConfigError("; ".join(errors))
    return Checked(dims=dims, device_type=device_type, model_path=model_path, records=records)


# --- the tokenizer -------------------------------------------------------------------------------


def ensure_tokenizer(texts: list[str], folder: Path) -> None:
    """Train the byte-level BPE into ``folder`` unless it is there. Training is deterministic, so when
    several torchrun ranks race, each writes a private folder and the first rename wins."""
    if folder.is_dir():
        return
    private = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    train_tokenizer(texts, DEFAULT_VOCAB_SIZE, private)
    try:
        private.rename(folder)
    except OSError:
        shutil.rmtree(private, ignore_errors=True)


def check_tokenized(records: list[dict], tokenizer_dir: str, seq_len: int) -> None:
    """Every record keeps at least one answer token within ``seq_len`` (else a rank would fail on it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    try:
        tokenize_records(records, tokenizer, seq_len)
    except (DataError, ValueError) as error:
        raise ConfigError(str(error)) from error


def prepare(cfg: DictConfig) -> Prepared:
    """Check the whole configuration and prepare shared files (the tokenizer); raise ConfigError."""
    checked = check_config(cfg)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = checked.model_path or str(output_dir / "tokenizer")
    if checked.model_path is None:
        ensure_tokenizer(training_texts(checked.records), Path(tokenizer_dir))
    check_tokenized(checked.records, tokenizer_dir, cfg.train.seq_len)
    return Prepared(
        dims=checked.dims, device_type=checked.device_type, model_path=checked.model_path, tokenizer_dir=tokenizer_dir
    )
