"""Fine-tune a Hugging Face causal LM with tensor parallelism (DTensor), configured with Hydra.

    python recipes/finetune.py model=llama tp=4 train.max_steps=5

The story of one run, each line one call: check the config -> start the ranks -> mesh -> model ->
TP plan (+ FSDP over dp) -> broadcast TP replicas -> optimizer -> per step: micro-batches forward and
backward -> finalise DTensor grads -> sync TP-replica grads -> grad norm and clip -> optimizer step ->
metrics, validation, checkpoint -> export a Hugging Face folder and a loss-curve PNG.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoTokenizer

from components.data import StepBatches, split_train_val
from components.distributed.fsdp import set_gradient_sync, shard_data_parallel
from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients, grad_norm
from components.distributed.launch import init_process_group, launch_local, started_by_launcher
from components.distributed.mesh import build_device_mesh, build_moe_mesh
from components.distributed.replica_drift import replica_drift
from components.distributed.tp_plan import apply_tp_plan, plan_for
from components.distributed.tp_replicas import broadcast_tp_replicas, synchronize_tp_replica_gradients
from components.models import build_causal_lm, materialize_from_pretrained, meta_causal_lm
from components.moe import apply_expert_parallel
from components.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from components.training.export import export_hf
from components.training.faults import (
    break_replica_sync,
    inject_after_backward,
    inject_after_update,
    inject_at_step_start,
    parse_fault,
)
from components.training.metrics import MetricsLog, plot_loss_curve
from components.training.schedule import warmup_cosine
from components.training.step import evaluate_loss_sum, forward_backward
from recipes.preflight import ConfigError, Prepared, compose_config, fail, model_config, prepare, records_for


@dataclass
class Run:
    rank: int
    device: torch.device
    mesh: DeviceMesh


def start(prepared: Prepared, seed: int) -> Run:
    """Join the process group and build the ("dp", "tp") mesh."""
    # On CUDA, gloo serves the few CPU tensors (metrics sums) and NCCL everything on the GPU.
    init_process_group("cpu:gloo,cuda:nccl" if prepared.device_type == "cuda" else "gloo")
    if prepared.device_type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(seed)
    if prepared.device_type == "cpu":  # ranks share the cores: more threads than cores only thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = torch.device(prepared.device_type, torch.cuda.current_device() if prepared.device_type == "cuda" else 0)
    return Run(dist.get_rank(), device, build_device_mesh(prepared.dims, prepared.device_type))


def build_model(cfg: DictConfig, prepared: Prepared, run: Run, vocab_size: int):
    """Build (seeded) or load (slice by slice) the model, then shard it: TP plan, then FSDP over dp."""
    config = model_config(cfg, prepared.model_path, vocab_size)
    if prepared.model_path is None:
        model = build_causal_lm(config, seed=cfg.seed).to(run.device)
    else:
        model = meta_causal_lm(config)  # nothing allocated until each rank loads its own shards
    report = None
    if prepared.dims.tp > 1:
        moe_modules = (*cfg.model.experts, *cfg.model.routers)
        report = apply_tp_plan(model, run.mesh["tp"], plan_for(config, cfg.sp), config, cfg.sp, moe_modules)
    apply_expert_parallel(model, build_moe_mesh(prepared.dims, prepared.device_type), list(cfg.model.experts))
    if prepared.model_path is not None:
        materialize_from_pretrained(model, prepared.model_path, device=str(run.device))
    if prepared.dims.dp > 1:
        shard_data_parallel(model, run.mesh["dp"])
    return model, config, report


def check_replicas(model, mesh: DeviceMesh, step: int, every: int) -> None:
    """Every ``every`` steps, stop (on every rank) if any TP-replicated parameter differs across ranks."""
    if every and step % every == 0:
        drifted = sorted(name for name, spread in replica_drift([model], mesh).items() if spread > 0)
        if drifted:
            raise RuntimeError(f"step {step}: TP replicas differ across ranks: {', '.join(drifted)}")


def validation_loss(model, batches: StepBatches, run: Run) -> float:
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    for input_ids, labels in batches.all_batches():
        totals[0] += evaluate_loss_sum(model, input_ids.to(run.device), labels.to(run.device))
        totals[1] += int((labels[:, 1:] != -100).sum())
    model.train()
    dist.all_reduce(totals, group=run.mesh["dp"].get_group())
    return (totals[0] / totals[1]).item()


def train(cfg: DictConfig, prepared: Prepared) -> None:
    run = start(prepared, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer_dir)
    train_records, val_records = split_train_val(records_for(cfg.data, cfg.seed), cfg.data.val_fraction, cfg.seed)
    dp, dp_rank = prepared.dims.dp, run.mesh["dp"].get_local_rank()
    common = dict(tokenizer=tokenizer, seq_len=cfg.train.seq_len, dp_size=dp, dp_rank=dp_rank, seed=cfg.seed)
    data = StepBatches(train_records, cfg.train.global_batch_size, cfg.train.micro_batch_size, **common)
    val_data = None  # data.val_fraction=0 leaves no validation set (preflight requires val_every=0 then)
    if val_records:
        val_data = StepBatches(val_records, cfg.train.micro_batch_size * dp, cfg.train.micro_batch_size, **common)

    model, config, report = build_model(cfg, prepared, run, len(tokenizer))
    if report is not None and run.rank == 0:
        print(report.format())
    fault = parse_fault(cfg.debug.fault)
    if fault is not None and fault.kind == "replica_sync_sum":
        break_replica_sync(model)
    broadcast_tp_replicas([model], run.mesh)
    optimizer = instantiate({k: v for k, v in cfg.optim.items() if k != "name"}, params=model.parameters())
    scheduler = warmup_cosine(optimizer, cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio)

    output_dir = Path(cfg.output_dir)
    checkpoints = output_dir / "checkpoints"
    resume = latest_checkpoint(checkpoints) if cfg.checkpoint.resume == "auto" else cfg.checkpoint.resume
    first_step = load_checkpoint(Path(resume), model, optimizer, scheduler)["step"] if resume else 0
    if run.rank == 0 and resume:
        print(f"resumed from {resume} at step {first_step}")
    log = MetricsLog(output_dir / "metrics.jsonl", run.rank == 0, first_step, cfg.train.max_steps)

    last_step = min(cfg.train.max_steps, cfg.train.stop_after or cfg.train.max_steps)
    for step in range(first_step, last_step):
        inject_at_step_start(fault, step + 1, run.rank, dist.get_world_size())
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        micro_batches = data.batches_for_step(step)
        global_tokens = data.tokens_in_step(step)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index, (input_ids, labels) in enumerate(micro_batches):
            set_gradient_sync(model, index == len(micro_batches) - 1)  # dp reduce once per step
            loss_sum += forward_backward(model, input_ids.to(run.device), labels.to(run.device), global_tokens)
        inject_after_backward(fault, model, step + 1, run.rank)
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], run.mesh)
        clip = cfg.train.clip_grad_norm
        norm = (clip_grad_norm_([model], clip) if clip else grad_norm([model])).item()
        finite = math.isfinite(norm)  # the same number on every rank, so all ranks decide alike
        if not finite and cfg.train.on_nonfinite == "stop":
            raise FloatingPointError(
                f"step {step + 1}: grad norm is {norm}; stopped before the update (train.on_nonfinite=skip skips it)"
            )
        lr = scheduler.get_last_lr()[0]
        if finite:
            optimizer.step()
        scheduler.step()
        inject_after_update(fault, model, step + 1, run.rank, dist.get_world_size())

        dist.all_reduce(loss_sum, group=run.mesh["dp"].get_group())
        elapsed = time.perf_counter() - started
        record = {
            "step": step + 1,
            "loss": (loss_sum / global_tokens).item(),
            "grad_norm": norm if finite else None,
            "lr": lr,
            "tokens_per_s": cfg.train.global_batch_size * cfg.train.seq_len / elapsed,
            **({} if finite else {"skipped": True}),
        }
        if (
            val_data is not None
            and cfg.train.val_every
            and ((step + 1) % cfg.train.val_every == 0 or step + 1 == cfg.train.max_steps)
        ):
            record["val_loss"] = validation_loss(model, val_data, run)
        log.log(record)
        check_replicas(model, run.mesh, step + 1, cfg.debug.check_replicas_every)
        if cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0:
            save_checkpoint(checkpoints, step + 1, model, optimizer, scheduler, keep=cfg.checkpoint.keep)
    log.close()

    drift = replica_drift([model], run.mesh)
    if run.rank == 0 and drift:
        worst = max(drift.values())
        (output_dir / "replica_drift.json").write_text(json.dumps({"max": worst, "tensors": drift}, indent=1))
        print(f"replica drift: largest difference between TP copies {worst} over {len(drift)} tensors")
    if cfg.checkpoint.export and last_step == cfg.train.max_steps:
        export_hf(model, config, output_dir / "hf", tokenizer=tokenizer)
    if run.rank == 0 and (output_dir / "metrics.jsonl").exists():
        plot_loss_curve(output_dir / "metrics.jsonl", output_dir / "loss.png")
        print(f"done: metrics, loss.png{' and hf/' if cfg.checkpoint.export else ''} in {output_dir}")
    dist.destroy_process_group()


def run_ranks(container: dict, prepared: Prepared) -> None:
    """Entry point of each rank started here: rebuild the config from a plain dict (cheap to hand over)."""
    train(OmegaConf.create(container), prepared)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        prepared = prepare(cfg)
    except ConfigError as error:
        fail(str(error))
    if started_by_launcher():
        train(cfg, prepared)
    else:
        launch_local(run_ranks, prepared.dims.world_size, OmegaConf.to_container(cfg, resolve=True), prepared)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if not any(a.startswith("-") for a in arguments):  # plain overrides: compose first for one-line errors
        compose_config(arguments)
    main()
