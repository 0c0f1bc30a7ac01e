"""Fine-tune a Hugging Face causal LM with tensor parallelism (DTensor), configured with Hydra.

    python recipes/finetune.py model=llama tp=4 train.max_steps=5

The story of one run: check everything once into a run plan (``recipes/checks.py``) -> start the
ranks -> set up (mesh, data, model sharded by ``components.models.parallelize``, TP replicas
broadcast, optimizer, schedule, resume) -> per step: micro-batches forward and backward, finalise
DTensor grads, sync TP-replica grads, grad norm and clip, optimizer step, metrics, validation,
checkpoint -> finish (drift report, export, loss curve).
"""

from __future__ import annotations  # the annotations below name classes imported only when needed

import errno
import functools
import importlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from components.runtime.launch import (
    end_launched_rank,
    fail_once,
    join_world,
    launch_local,
    start_fresh_line,
    started_by_launcher,
)
from recipes.problems import say  # every line a run prints: rank 0's alone

# Above: what the driver needs to compose the config and start the ranks (torch is the floor
# every command pays). What ranks alone run (DTensor, DCP, FSDP, model, data and tokenizer code)
# is imported by the functions that use it, so that --help and --cfg job take about the time of
# `import torch, hydra` (tests/e2e/test_first_hour.py). The checks import most of it before the
# local launcher forks the ranks, which inherit it.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from components.checkpoint.writer import CheckpointWriter
    from components.data import StepBatches
    from components.distributed.context_parallel import ContextParallel
    from components.distributed.replicas import ReplicaSync
    from components.moe import ExpertLoad
    from components.training.loggers import MetricsLogger
    from components.training.metrics import MetricsLog
    from recipes.plan import RunPlan


# The recipe's own launcher's status after a SIGTERM or SIGUSR1 stopped the run with a checkpoint:
# sysexits' EX_TEMPFAIL, "try again later" (0: done; 1: an error; 128 + N: killed by signal N before
# a checkpoint).
STOPPED_STATUS = 75
# Ctrl-C before any rank started (the checks, tokenizing): one line, 128 + SIGINT like a shell.
INTERRUPTED_STATUS = 130
INTERRUPTED = (
    "error: interrupted (Ctrl-C) before any rank started: nothing was trained or claimed, and the "
    "cache keeps only finished data (its scratch folder was removed)"
)


@dataclass(kw_only=True)
class Run:
    """One rank's handles: where it is, what it trains, and with what."""

    rank: int
    device: torch.device
    mesh: DeviceMesh
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: StepBatches
    val_data: StepBatches | None
    first_step: int  # steps already done (by the checkpoint resumed from)
    compute: Callable[
        [], AbstractContextManager
    ]  # the precision's context for forward passes (autocast or none)
    experts: ExpertLoad | None  # tokens per expert of an MoE model, for the step's imbalance
    aux_loss_weight: (
        float  # of an MoE model's load-balancing loss (0: its config does not enable it)
    )
    replicas: ReplicaSync  # the TP replica gradient sync, built once: its plan and buffers last
    cp: ContextParallel | None  # this rank's context-parallel group (None at cp=1)
    before_commit: Callable[[Path], None] | None = (
        None  # the checkpoint writer's callback (a fault, in tests)
    )


def set_up(plan: RunPlan) -> Run:
    """Everything a rank needs before its first step: mesh, data, model, optimizer, schedule,
    resume."""
    from components.data.loader import open_splits
    from components.debug.faults import install_faults
    from components.distributed.context_parallel import ContextParallel
    from components.distributed.mesh import build_device_mesh
    from components.distributed.replicas import ReplicaSync
    from components.models.parallelize import build_parallel_model
    from components.models.precision import precision_policy
    from components.moe import ExpertLoad, router_aux_loss_weight
    from components.targets import target_class
    from components.training.schedule import build_schedule

    train, optim, timeout = plan.train, plan.optim, plan.collective_timeout
    device = join_world(plan.device_type, timeout, plan.cpu_threads, plan.seed, train.tf32)
    rank, mesh = dist.get_rank(), build_device_mesh(plan.dims, plan.device_type, timeout)
    shards = dict(dp_size=plan.dims.dp, dp_rank=mesh["dp"].get_local_rank(), seed=plan.seed)
    splits = (plan.data.train, plan.data.val, train.global_batch_size, train.micro_batch_size)
    data, val_data = open_splits(*splits, **shards, pad_multiple=plan.pad_multiple)
    model, report = build_parallel_model(plan.model, plan.dims, mesh, device, timeout)
    if report is not None:
        say(report.format())
    replicas = ReplicaSync([model], mesh)  # after parallelising and loading, before the optimizer
    replicas.broadcast()
    optimizer = target_class("optim", optim.target)(model.parameters(), **optim.options())
    schedule = plan.schedule
    scheduler = build_schedule(
        optimizer, schedule.name, train.warmup_steps, train.max_steps, schedule.options()
    )
    first_step = _resume(plan, model, optimizer, scheduler)
    precision = precision_policy(plan.model.precision)  # the same policy the model was built with
    data_parallel = plan.dims.data_parallel > 1  # FSDP over dp × cp
    compute = functools.partial(precision.autocast, device.type, data_parallel=data_parallel)
    micro_batches = data.micro_batches_per_step
    watched = (model, plan.model.config, list(plan.model.experts), mesh["dp"].get_group())
    experts = ExpertLoad.watch(*watched, plan.model.routers, plan.moe.routing_bias_rate)
    aux = router_aux_loss_weight(plan.model.config, micro_batches, plan.dims.dp)
    run = Run(
        rank=rank,
        device=device,
        mesh=mesh,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        val_data=val_data,
        first_step=first_step,
        compute=compute,
        experts=experts,
        aux_loss_weight=aux,
        replicas=replicas,
        cp=ContextParallel.of(mesh),
    )
    where = dict(rank=rank, world_size=dist.get_world_size(), first_step=first_step)
    run.before_commit = install_faults(
        plan.fault, model, optimizer, **where, micro_batches_per_step=micro_batches
    )
    return run


def _resume(
    plan: RunPlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """The steps already done: 0 for a fresh run, else those of the checkpoint
    ``plan.resume_from``, loaded into the model, optimizer and scheduler."""
    from components.checkpoint.dcp import load_checkpoint

    if plan.resume_from is None:
        return 0
    first_step = load_checkpoint(plan.resume_from, model, optimizer, scheduler)["step"]
    say(f"resumed from {plan.resume_from} at step {first_step}")
    return first_step


def train_step(run: Run, plan: RunPlan, step: int) -> dict:
    """One optimizer step (0-based ``step``): micro-batches, gradient reductions, clip, update; its
    metrics."""
    from components.distributed.fsdp import set_gradient_sync
    from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients, grad_norm
    from components.distributed.mesh import data_parallel_mesh
    from components.training.memory import peak_memory_gib, reset_peak_memory
    from components.training.metrics import matmul_math, throughput
    from components.training.step import forward_backward  # its loss reads the models' TP plans

    started = time.perf_counter()
    reset_peak_memory(run.device)
    run.optimizer.zero_grad(set_to_none=True)
    micro_batches, labelled = run.data.batches_for_step(step), run.data.labels_in_step(step)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # mesh groups: NCCL only
    for index, batch in enumerate(batch.to(run.device) for batch in micro_batches):
        set_gradient_sync(run.model, index == len(micro_batches) - 1)  # dp reduce once per step
        if run.experts:  # the step's imbalance counts real tokens, not the padding
            run.experts.count_real(batch.real_mask())
        tensors = (batch.input_ids, batch.labels, labelled, batch.position_ids)
        chunk = plan.train.loss_chunk_tokens
        options = (run.compute(), run.aux_loss_weight, chunk, run.cp)
        loss_sum += forward_backward(run.model, *tensors, *options)
    finalize_dtensor_gradients([run.model])
    run.replicas.synchronize()
    clip = plan.train.clip_grad_norm
    norm = (clip_grad_norm_([run.model], clip) if clip else grad_norm([run.model])).item()
    finite = math.isfinite(norm)  # the same number on every rank, so all ranks decide alike
    if not finite and plan.train.on_nonfinite == "stop":
        raise FloatingPointError(
            f"step {step + 1}: grad norm is {norm}; stopped before the update "
            "(train.on_nonfinite=skip skips it)"
        )
    lr = run.scheduler.get_last_lr()[0]
    if finite:
        run.optimizer.step()
    run.scheduler.step()
    dist.all_reduce(loss_sum, group=data_parallel_mesh(run.mesh).get_group())  # over dp × cp
    peak = torch.tensor(peak_memory_gib(run.device), dtype=torch.float64, device=run.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the busiest rank's
    elapsed, tokens = time.perf_counter() - started, run.data.tokens_in_step(step)
    return {
        "step": step + 1,
        "loss": (loss_sum / labelled).item(),
        "grad_norm": norm if finite else None,
        "lr": lr,
        "tokens": tokens,
        **throughput(
            tokens,
            elapsed,
            plan.flops_per_token,
            dist.get_world_size(),
            run.device,
            matmul_math(plan.train.precision, plan.train.tf32),
        ),
        "peak_memory_gib": peak.item(),
        **(run.experts.metrics(plan.moe.expert_load == "experts") if run.experts else {}),
        **({} if finite else {"skipped": True}),
    }


def train(run: Run, plan: RunPlan) -> tuple[str | None, int]:
    """The steps after ``run.first_step`` up to ``max_steps`` (or ``stop_after``): metrics,
    validation, saves. Returns the name of the signal that stopped the run early (with a checkpoint
    of its step), or None; and how many steps were skipped as non-finite."""
    from components.distributed.replicas import check_replicas

    train_cfg = plan.train
    log, tracker, writer = _open_outputs(run, plan)
    stopped, done, skipped = None, run.first_step, 0  # done: the last step done
    state = (run.model, run.optimizer, run.scheduler)
    last = min(train_cfg.max_steps, train_cfg.stop_after or train_cfg.max_steps)
    for step in range(run.first_step, last):
        record = train_step(run, plan, step) | writer.take_stall()  # the save after the last step
        done, skipped = step + 1, skipped + bool(record.get("skipped"))
        if _validation_due(plan, done) and run.val_data is not None:
            record["val_loss"] = _validation_loss(run, plan)
        log.log(record)
        tracker.log_metrics(record, record["step"])
        if plan.check_replicas_every and done % plan.check_replicas_every == 0:
            check_replicas([run.model], run.mesh, done)
        every = plan.checkpoint.every_steps
        if every and done % every == 0:
            writer.save(done, *state)
        stopped = _stop_signal(writer, done, state)
        if stopped is not None:
            break
    if stopped is None and run.first_step < done < train_cfg.max_steps and writer.last_step != done:
        writer.save(done, *state)  # train.stop_after, as a stop signal: the last step's checkpoint
    writer.close()  # the run ends only once its last save is published
    log.close()
    tracker.close()
    if stopped is not None and run.rank == 0:
        _print_stop_note(stopped, done, plan, writer)
    return stopped, skipped


def _open_outputs(run: Run, plan: RunPlan) -> tuple[MetricsLog, MetricsLogger, CheckpointWriter]:
    """What the steps write to: metrics.jsonl, the tracker (``logger=...``, on rank 0 only) and the
    checkpoint writer."""
    import yaml

    from components.checkpoint.writer import CheckpointWriter
    from components.training.loggers import open_logger
    from components.training.metrics import MetricsLog

    first_step = run.first_step
    log = MetricsLog(
        plan.output_dir / "metrics.jsonl", run.rank == 0, first_step, plan.train.max_steps
    )
    logger, hparams = plan.logger, yaml.safe_load(plan.config_yaml)
    tracker = open_logger(
        logger.target, logger.options(), plan.output_dir, first_step, hparams, run.rank == 0
    )
    ids = dict(keep=plan.checkpoint.keep, run_id=plan.run_id, run_info=plan.run_info)
    writer = CheckpointWriter(
        plan.checkpoints,
        **ids,
        asynchronous=plan.checkpoint.asynchronous,
        before_commit=run.before_commit,
    )
    return log, tracker, writer


def _validation_due(plan: RunPlan, done: int) -> bool:
    """Whether step ``done`` validates: every ``train.val_every`` steps and after the last (never
    with ``train.val_every=0``)."""
    train_cfg = plan.train
    every = train_cfg.val_every
    return bool(every) and (done % every == 0 or done == train_cfg.max_steps)


def _validation_loss(run: Run, plan: RunPlan) -> float:
    """The mean loss on the validation split, the same on every rank."""
    from components.distributed.mesh import data_parallel_mesh
    from components.training.validation import validation_loss

    dp_group = data_parallel_mesh(run.mesh).get_group()  # dp × cp
    return validation_loss(
        run.model,
        run.val_data,
        run.device,
        dp_group,
        run.compute(),
        plan.train.loss_chunk_tokens,
        run.cp,
    )


def _stop_signal(writer: CheckpointWriter, done: int, state: tuple) -> str | None:
    """The name of the signal that stops the run after step ``done`` (with a checkpoint of it), or
    None. One all-reduce per step: a SIGTERM or SIGUSR1 on any rank stops every rank."""
    from components.runtime import preemption

    if not writer.after_step(preemption.stop_requested() is not None):
        return None
    own = preemption.stop_requested()
    stopped = own.name if own is not None else "a signal to another rank"
    if writer.last_step != done:  # a checkpoint of this step, even with every_steps=0
        writer.save(done, *state)
    return stopped


def _print_stop_note(stopped: str, done: int, plan: RunPlan, writer: CheckpointWriter) -> None:
    """The stop's ``note:`` line on stderr: the signal, the checkpoint, how to continue."""
    say(
        f"note: stopped by {stopped} after step {done} of {plan.train.max_steps}: "
        f"checkpoint {writer.last_path}; checkpoint.resume=auto continues (exit status "
        f"{STOPPED_STATUS})",
        file=sys.stderr,
        flush=True,
    )


# A run with more than this share of its steps skipped as non-finite (train.on_nonfinite=skip)
# fails: its model is barely trained, so it is not exported (skip is for the rare bad batch).
MOST_SKIPPED = 0.5


def skipped_verdict(skipped: int, steps: int) -> tuple[bool, str | None]:
    """(whether the run fails, the line saying how many of its ``steps`` were ``skipped`` as
    non-finite; None when none were)."""
    if not skipped:
        return False, None
    fails = skipped > MOST_SKIPPED * steps
    what = f"{skipped} of {steps} steps {'was' if skipped == 1 else 'were'} skipped as non-finite"
    if fails:
        return True, (
            f"{what} (train.on_nonfinite=skip; more than {MOST_SKIPPED:.0%} fails the run): the "
            "model is barely trained, so hf/ was not exported; metrics.jsonl and any checkpoints "
            "are kept. Lower optim.lr, set train.clip_grad_norm, or use train.on_nonfinite=stop"
        )
    updates = "its update was" if skipped == 1 else "their updates were"
    return False, f"warning: {what} (train.on_nonfinite=skip): {updates} not applied"


def finish(run: Run, plan: RunPlan, stopped: bool = False, skipped: int = 0) -> None:
    """The replica drift report (any drift stops the run before export), the export and the loss
    curve; after a stop signal (``stopped``) only the loss curve: the run is to be resumed, and soon
    killed. More than :data:`MOST_SKIPPED` of the run's steps ``skipped`` as non-finite: no export,
    and the run fails with one ``error:`` line."""
    from transformers import AutoTokenizer

    from components.checkpoint.export import export_dtype, export_hf
    from components.distributed.replicas import write_drift_report
    from components.training.metrics import plot_loss_curve

    output_dir, train = plan.output_dir, plan.train
    if not stopped:
        write_drift_report([run.model], run.mesh, output_dir / "replica_drift.json", run.rank)
    ended = (train.stop_after or train.max_steps) >= train.max_steps and not stopped
    last = min(train.max_steps, train.stop_after or train.max_steps)
    fails, note = skipped_verdict(skipped, last - run.first_step) if not stopped else (False, None)
    if plan.checkpoint.export and ended and not fails:
        source = plan.model.weights
        export_hf(
            run.model,
            plan.model.config,
            output_dir / "hf",
            tokenizer=AutoTokenizer.from_pretrained(plan.tokenizer_dir, trust_remote_code=False),
            dtype=export_dtype(plan.checkpoint.export_dtype, source),
            source_dir=source,
            recipe="recipes/finetune.py",
            config_yaml=plan.config_yaml,
            base_model=plan.base_model,
        )
    if run.rank == 0 and (output_dir / "metrics.jsonl").exists():
        plot_loss_curve(output_dir / "metrics.jsonl", output_dir / "loss.png")
        if note and not fails:
            say(note, file=sys.stderr)
        if not fails:
            say(done_line(plan, ended, exported=plan.checkpoint.export and ended))
    dist.destroy_process_group()
    if fails:
        fail_once(note)  # every rank exits 1; rank 0 prints the one error: line


def done_line(plan: RunPlan, ended: bool, exported: bool) -> str:
    """The run's last line, naming only what it left: ``hf/`` only when exported now, and before the
    end (``train.stop_after``, a stop signal) the checkpoint ``checkpoint.resume=auto`` continues
    from."""
    from components.checkpoint.integrity import complete_checkpoints

    wrote = ["metrics", "loss.png", *(["hf/"] if exported else [])]
    if ended or not (checkpoints := complete_checkpoints(plan.checkpoints)):
        return f"done: {', '.join(wrote[:-1])} and {wrote[-1]} in {plan.output_dir}"
    latest = checkpoints[-1]
    return (
        f"done: metrics, loss.png and checkpoint {latest.name} in {plan.output_dir} (no hf/ before "
        f"step {plan.train.max_steps}); checkpoint.resume=auto continues from it"
    )


def rank_main(plan: RunPlan) -> str | None:
    """What every rank runs: set up, train, finish. Returns the stop signal's name (see
    ``train``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from components.runtime import preemption

    preemption.install()  # first: a SIGTERM or SIGUSR1 from now on stops the run after a step
    run = set_up(plan)
    if started_by_launcher():  # torchrun: rank 0 claimed the folder; every rank takes its run id
        ids = [plan.run_id]
        dist.broadcast_object_list(ids, src=0)
        plan = replace(plan, run_id=ids[0])
    try:
        stopped, skipped = train(run, plan)
        finish(run, plan, stopped is not None, skipped)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        if (full := disk_full(error, plan)) is not None:  # said plainly, on the error line
            raise OSError(errno.ENOSPC, full) from error
        raise
    return stopped


# Free space below which a failed write is taken for a full disk (torch's checkpoint writer
# reports one as "unexpected pos 704 vs 598", without the errno).
FULL_BYTES = 64 * 2**20


def disk_full(error: BaseException, plan: RunPlan) -> str | None:
    """What a write that failed on a full disk under ``plan.output_dir`` says (the folder, the
    space left, the checkpoint that survives), or None when ``error`` is not that."""
    from components.checkpoint.integrity import complete_checkpoints

    chain, cause = [], error
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    try:
        free = shutil.disk_usage(plan.output_dir).free
    except OSError:
        return None
    if not (enospc or "No space left on device" in str(error) or free < FULL_BYTES):
        return None
    kept = complete_checkpoints(plan.checkpoints)
    survives = (
        f"the last complete checkpoint, {kept[-1].name}, is kept: free space and "
        "checkpoint.resume=auto continues from it"
        if kept
        else "no checkpoint was written yet: free space and run again"
    )
    return (
        f"no space left on device in {plan.output_dir} ({free / 2**20:.1f} MiB free): {survives}, "
        "or choose an output_dir on another disk"
    )


def local_rank_main(plan: RunPlan) -> str | None:
    """``rank_main`` for a rank of the recipe's own launcher (``max_restarts``): after a restart the
    plan's checkpoint (chosen before the first attempt) is chosen again, the last complete one."""
    from recipes.outputs import choose_checkpoint

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        resume_from = choose_checkpoint(
            plan.checkpoint.resume, plan.train.max_steps, plan.checkpoints, plan.run_info
        )
        at = f"from {resume_from}" if resume_from is not None else "from step 0"
        say(f"note: restart {restart} of {plan.max_restarts} after a rank failed: {at}")
        plan = replace(plan, resume_from=resume_from)
    return rank_main(plan)


# What the rank functions import inside themselves (so --help stays light), imported once by the
# launcher before it forks the ranks, which then share them, instead of once by every rank
# (tests/unit/recipes/test_rank_modules.py keeps the list in step with the functions).
RANK_MODULES = (
    "yaml",
    "transformers",
    "torch.distributed.checkpoint.api",
    "components.checkpoint.dcp",
    "components.checkpoint.export",
    "components.checkpoint.integrity",
    "components.checkpoint.writer",
    "components.data.loader",
    "components.debug.faults",
    "components.distributed.context_parallel",
    "components.distributed.fsdp",
    "components.distributed.grads",
    "components.distributed.mesh",
    "components.distributed.replicas",
    "components.models.parallelize",
    "components.models.precision",
    "components.moe",
    "components.runtime.preemption",
    "components.targets",
    "components.training.loggers",
    "components.training.memory",
    "components.training.metrics",
    "components.training.schedule",
    "components.training.step",
    "components.training.validation",
    "recipes.outputs",
)


def launch(cfg: DictConfig, job_dir: str | None, hydra_run_dir: str | None) -> None:
    """Check and plan once, then run the ranks: here (torchrun started us) or as local processes.
    ``job_dir``: a sweep job's own folder; ``hydra_run_dir``: checked to agree with output_dir."""
    from recipes.checks import ConfigError, fail, plan_run

    try:
        plan, lock = plan_run(cfg, job_dir, hydra_run_dir)  # the run owns output_dir until released
    except ConfigError as error:
        fail(error.problems)
    except KeyboardInterrupt:  # Ctrl-C while checking or tokenizing: no rank has started
        start_fresh_line(sys.stderr)
        say(INTERRUPTED, file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_STATUS) from None
    if plan.dry_run:  # checked: the layout is built on fake ranks and priced; nothing runs
        from components.planning.dry_run import dry_run

        return dry_run(plan, fail)
    if lock is not None:  # rank 0 of torchrun, or the local launcher
        (plan.output_dir / "config.yaml").write_text(plan.config_yaml)
    for module in RANK_MODULES:  # once, before the fork
        importlib.import_module(module)
    try:
        if (
            started_by_launcher()
        ):  # torchrun: a stopped rank exits 0 (another status would restart it)
            rank_main(plan)
        else:
            restarts = dict(max_restarts=plan.max_restarts)
            results = launch_local(local_rank_main, plan.dims.world_size, plan, **restarts)
    finally:  # the folder is free again once the ranks are done
        if lock is not None:
            lock.release()
    if not started_by_launcher() and any(
        results.values()
    ):  # stopped by a signal, checkpoint written
        raise SystemExit(STOPPED_STATUS)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    """Hydra's own entry (``--multirun``, ``--cfg``, ``--help``): each job writes to its own
    folder."""
    job = HydraConfig.get()
    run_dir_given = any(override.startswith("hydra.run.dir=") for override in job.overrides.hydra)
    if job.mode == RunMode.MULTIRUN:  # its own folder; a failure is noted, and the next job runs
        sweep_job(
            job.job.num, list(job.overrides.task), lambda: launch(cfg, job.runtime.output_dir, None)
        )
    elif not run_dir_given:  # output_dir (as Hydra resolved it: the same date and time)
        launch(cfg, job.runtime.output_dir, None)
    else:  # a run dir of the user's own: it must be output_dir
        launch(cfg, None, job.run.dir)


# The jobs of a --multirun sweep as they end: (number, overrides, exit status), for its summary.
SWEEP_JOBS: list[tuple[int, list[str], int]] = []


def sweep_job(number: int, overrides: list[str], job: Callable[[], None]) -> None:
    """Run one job of a sweep and note how it ended. Its failure (already said in its own
    ``error:`` line) does not stop the sweep, as Hydra's users expect; a signal (Ctrl-C, SIGTERM:
    status 128 + N) does, once noted."""
    status = 0
    try:
        job()
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    except Exception as error:  # noqa: BLE001 - any job's failure: said, then the next job runs
        say(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        status = 1
    SWEEP_JOBS.append((number, overrides, status))
    if status >= 128:
        raise SystemExit(status)


def sweep_summary(jobs: list[tuple[int, list[str], int]]) -> tuple[list[str], int]:
    """The lines that end a sweep (one per job: its overrides that differ between jobs, and how it
    ended) and the sweep's exit status: 0 when every job was done, else the first failure's (a
    signal's, when one stopped the sweep)."""
    shared = set.intersection(*(set(overrides) for _, overrides, _ in jobs))
    failed = [status for _, _, status in jobs if status]
    lines = [f"sweep: {len(jobs) - len(failed)} of {len(jobs)} jobs done, {len(failed)} failed"]
    for number, overrides, status in jobs:
        own = " ".join(override for override in overrides if override not in shared) or "-"
        how = "done" if status == 0 else f"failed (exit status {status})"
        lines.append(f"  job {number} ({own}): {how}")
    if failed and failed[-1] >= 128:
        lines.append(
            f"  the sweep was stopped by a signal after job {jobs[-1][0]}: later jobs did not run"
        )
    status = next((code for code in failed if code >= 128), failed[0] if failed else 0)
    return lines, status


def end_sweep() -> None:
    """After a sweep: its summary on stderr, and exit with its status when a job failed."""
    if not SWEEP_JOBS:
        return
    lines, status = sweep_summary(SWEEP_JOBS)
    start_fresh_line(sys.stderr)
    say("\n".join(lines), file=sys.stderr, flush=True)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if any(argument.startswith("-") for argument in arguments):
        try:
            hydra_main()
        finally:  # a --multirun sweep: every job's status, and the sweep's
            end_sweep()
    else:  # plain overrides: compose here, so that a composition error is one line
        from recipes.checks import compose

        composed = compose(arguments)
        # only a run dir the user gave: the default is ${output_dir}, and its ${now:...} read a
        # moment later can name the next second's folder
        given = any(argument.startswith("hydra.run.dir=") for argument in arguments)
        launch(composed, None, composed.hydra.run.dir if given else None)
    if (
        started_by_launcher()
    ):  # after every job: a torchrun rank ends like a local one (see end_launched_rank)
        end_launched_rank()
