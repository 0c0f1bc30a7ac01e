"""Everything checked and prepared once, in the launching process, before any rank starts.

Each problem becomes one ``error:`` line on stderr and exit status 2, in seconds: no traceback wall,
no rank left waiting. Checks: Hydra composition (unknown group option, misspelt key), sizes that do
not factor the world, plan divisibility (heads, kv heads, intermediate size by tp), missing paths, a
malformed data file, batch sizes that do not divide.
"""

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.data import (
    DEFAULT_VOCAB_SIZE,
    DataError,
    generate_examples,
    read_jsonl,
    train_tokenizer,
    training_texts,
)
from components.distributed.launch import started_by_launcher
from components.distributed.mesh import ParallelDims, resolve_parallel_dims
from components.distributed.tp_plan import check_plan, plan_for
from components.models import load_config, meta_causal_lm, tiny_config
from components.moe import check_expert_parallel

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what to change."""


@dataclass(frozen=True)
class Prepared:
    """What the ranks need beyond the config: sizes, the device, and resolved paths."""

    dims: ParallelDims
    device_type: str
    model_path: str | None  # a Hugging Face folder to load; None builds the tiny config
    tokenizer_dir: str


def fail(message: str) -> None:
    """Print one ``error:`` line (the first paragraph of the message) and exit 2."""
    first = message.strip().split("\n\n")[0].replace("\n", " ")
    print(f"error: {first}", file=sys.stderr)
    sys.exit(2)


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose like ``hydra.main`` would, but catch composition errors so they print as one line."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        fail(str(error))


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
    errors = []
    train = cfg.train
    for key in ("max_steps", "global_batch_size", "micro_batch_size"):
        if train[key] < 1:
            errors.append(f"train.{key} must be at least 1, got {train[key]}")
    if train.seq_len < 2:
        errors.append(f"train.seq_len must be at least 2, got {train.seq_len}")
    if not errors and train.global_batch_size % (train.micro_batch_size * dims.dp):
        errors.append(
            f"train.global_batch_size ({train.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({train.micro_batch_size}) × dp ({dims.dp})"
        )
    if cfg.optim.lr <= 0:
        errors.append(f"optim.lr must be positive, got {cfg.optim.lr}")
    if cfg.checkpoint.every_steps < 0:
        errors.append(f"checkpoint.every_steps must be 0 (off) or positive, got {cfg.checkpoint.every_steps}")
    resume = cfg.checkpoint.resume
    if resume not in (None, "auto") and not Path(resume).is_dir():
        errors.append(f"checkpoint.resume {resume!r} is not a checkpoint folder (use auto, null or a path)")
    return errors


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


def prepare(cfg: DictConfig) -> Prepared:
    """Check the whole configuration and prepare shared files (the tokenizer); raise ConfigError."""
    OmegaConf.resolve(cfg)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dims = resolve_parallel_dims(world_size_for(cfg, device_type), tp=cfg.tp, dp=cfg.dp, ep=cfg.ep)
        errors = check_numbers(cfg, dims)
        model_path = resolve_model_path(cfg)
        config = model_config(cfg, model_path, DEFAULT_VOCAB_SIZE)
        moe_modules = (*cfg.model.experts, *cfg.model.routers)
        if dims.tp > 1:
            meta = meta_causal_lm(config)
            errors += check_plan(meta, config, plan_for(config, cfg.sp), dims.tp, moe_modules)[1]
        if dims.ep > 1:
            num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
            errors += check_expert_parallel(
                meta_causal_lm(config), list(cfg.model.experts), num_experts, dims.ep, dims.tp
            )
            if dims.dp > 1:
                errors.append(f"ep={dims.ep} with dp={dims.dp} is not supported yet: use dp=1 (ep folds onto tp)")
        records = records_for(cfg.data, cfg.seed)
    except (ValueError, FileNotFoundError, DataError) as error:
        raise ConfigError(str(error)) from error
    if errors:
        raise ConfigError("; ".join(errors))

    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = model_path or str(output_dir / "tokenizer")
    if model_path is None:
        ensure_tokenizer(training_texts(records), Path(tokenizer_dir))
    return Prepared(dims=dims, device_type=device_type, model_path=model_path, tokenizer_dir=tokenizer_dir)
