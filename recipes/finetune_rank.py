"""What each rank of ``recipes/finetune.py`` runs: the story of one run, read top to bottom.

Set up (mesh, data, model built, converted, parallelised, TP replicas broadcast, optimizer,
schedule, resume), train (per step: the step function, finalise DTensor grads, sync TP-replica
grads, clip, update, metrics; validation and checkpoints as the cadence says), finish (drift report,
export, loss curve). The launcher imports this module before it forks the ranks, so each rank
starts with every module here already imported.
"""

import functools
import math
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import yaml

from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter
from components.data.loader import Batch
from components.data.streaming import StreamBatches, open_loaders
from components.debug.faults import install_faults
from components.distributed import tp_replicas
from components.distributed.context_parallel import ContextParallel
from components.distributed.fsdp import set_gradient_sync
from components.distributed.grads import clip_grad_norm_, grad_norm
from components.distributed.pipeline import build_pipeline
from components.distributed.replicas import check_replicas, write_drift_report
from components.distributed.step_finalizer import StepFinalizer
from components.models.conversion import convert_model
from components.models.fp8 import fp8_scales_after_steps
from components.models.parallelize import build_parallel_model
from components.models.precision import precision_policy
from components.moe import ExpertLoad, load_metrics, router_aux_loss_weight, uncounted_experts
from components.planning.memory import reset_peak_memory
from components.runtime import heartbeat, preemption
from components.runtime.checkpoints import done_line, resume, stop_note, stop_signal
from components.runtime.exit_status import disk_full_said_plainly, skipped_verdict
from components.runtime.launch import fail_once
from components.runtime.problems import say  # say: rank 0's lines alone
from components.runtime.ranks import local_restart
from components.runtime.world import join_world
from components.training.compile_counts import CompileCounts
from components.training.loggers import MetricsLogger, open_logger
from components.training.metrics import MetricsLog, matmul_math, plot_loss_curve, throughput
from components.training.optimizer import build_optimizer
from components.training.profiler import StepProfiler
from components.training.readout import StepReadout
from components.training.schedule import build_schedule
from components.training.step import forward_backward_on_device  # reads the models' TP plans
from components.training.validation import validation_losses
from recipes.export import export, export_folders
from recipes.plan import RecipeSteps, Run, RunPlan, StepsOf
from recipes.prepare import resume_again


def convert(model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
    """The built model, converted before it is parallelised: ``peft=lora``'s adapters, fp8's float8
    linears (components/models/conversion.py); full fine-tuning in another precision keeps it."""
    return convert_model(model, plan.lora, plan.fp8, plan.seed)


def set_up(plan: RunPlan) -> Run:
    """Everything a rank needs before step 1: mesh, data, model, optimizer, schedule, resume."""
    train, optim, timeout, dims = plan.train, plan.optim, plan.collective_timeout, plan.dims
    device = join_world(plan.device_type, timeout, plan.cpu_threads, plan.seed, train.tf32)
    rank, meshes = dist.get_rank(), dims.build_meshes(plan.device_type, timeout)
    sizes = dict(dp_size=dims.dp, dp_rank=meshes.batch.get_local_rank(), seed=plan.seed)
    splits = (plan.data.train, plan.data.val, plan.data.val_sources, train.global_batch_size)
    sizes |= dict(group=meshes.batch.get_group(), pad_multiple=plan.pad_multiple)
    data, val_data, val_sources = open_loaders(*splits, train.micro_batch_size, **sizes)
    converted = functools.partial(convert, plan=plan)
    model, report = build_parallel_model(plan.model, dims, meshes, device, converted)
    if report is not None:
        say(report.format())
    tp_replicas.broadcast_tp_replicas([model], meshes.world)  # loaded, before the optimizer
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = build_optimizer(optim.target, trained, optim.options())  # no frozen state
    fp8_scales_after_steps(optimizer, model, plan.fp8)  # fp8 under FSDP: one all-reduce a step
    warmup, max_steps, options = train.warmup_steps, train.max_steps, plan.schedule.options()
    schedule = build_schedule(optimizer, plan.schedule.name, warmup, max_steps, options)
    watched = (model, plan.model.config, list(plan.model.experts), meshes.batch.get_group())
    experts = ExpertLoad.watch(*watched, plan.model.routers, plan.moe.routing_bias_rate)
    if uncounted := uncounted_experts(model, list(plan.model.experts), plan.model.routers):
        say(f"note: expert choices not counted (tokens come routed, no router beside): {uncounted}")
    stream = data if isinstance(data, StreamBatches) else None  # its position: the checkpoint's
    state = TrainState(model=model, optimizer=optimizer, schedule=schedule, stream=stream)
    resume(plan.resume_from, state)  # every part of the state: the routing bias too, the step
    precision = precision_policy(plan.model.precision)
    compute = functools.partial(precision.autocast, device.type, fsdp=plan.fsdp_wraps)
    pipeline = build_pipeline(model, meshes.world, compute, data, *plan.pipeline)  # None at pp=1
    micro_batches = data.micro_batches_per_step
    aux_loss_weight = router_aux_loss_weight(plan.model.config, micro_batches, dims.dp)
    finalizer = StepFinalizer()  # its checks join the readout's one read
    run = Run(
        rank=rank,
        device=device,
        meshes=meshes,
        state=state,
        data=data,
        val_data=val_data,
        val_sources=val_sources,
        first_step=state.step,
        compute=compute,
        experts=experts,
        aux_loss_weight=aux_loss_weight,
        cp=ContextParallel.of(meshes.world),
        finalize_gradients=finalizer,
        readout=StepReadout(meshes.loss.get_group(), device, finalizer),  # the loss's dp × cp
        pipeline=pipeline,
        reduce_each_micro_batch=plan.reduce_each_micro_batch,
    )
    if plan.fault is not None:  # a resilience drill (docs/fault-injection.md)
        where = dict(rank=rank, world_size=dist.get_world_size(), first_step=state.step)
        where |= dict(micro_batches_per_step=data.micro_batches_per_step)
        run.before_commit = install_faults(plan.fault, model, optimizer, **where)
    return run


def step_micro_batches(run: Run, step: int) -> Iterator[Batch]:
    """Step ``step``'s micro-batches on the device, for a step function's forward and backward:
    each marked on the heartbeat, the dp gradient reduce on for the last alone (for each with
    ``run.reduce_each_micro_batch``), its real tokens counted by an MoE model's expert load."""
    micro_batches = run.data.batches_for_step(step)
    for index, batch in enumerate(batch.to(run.device) for batch in micro_batches):
        heartbeat.progress(f"step {step + 1}, micro-batch {index + 1}")  # a mark: 0.2 µs
        last = index == len(micro_batches) - 1
        set_gradient_sync(run.state.model, last or run.reduce_each_micro_batch)
        if run.experts:  # the step's imbalance counts real tokens, not the padding
            run.experts.count_real(batch.real_mask())
        yield batch


def forward_backward_step(run: Run, plan: RunPlan, step: int) -> torch.Tensor:
    """The step function: forward and backward of step ``step``'s micro-batches, the summed loss
    (float64). With pp the rank's pipeline replaces it (:func:`finetune_steps`)."""
    labelled = run.data.labels_in_step(step)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # mesh groups: NCCL only
    for batch in step_micro_batches(run, step):
        tensors = (batch.input_ids, batch.labels, labelled, batch.position_ids)
        options = (run.compute(), run.aux_loss_weight, plan.train.loss_chunk_tokens, run.cp)
        real = batch.real_mask() if run.aux_loss_weight else None  # the load-balancing loss's
        loss_sum += forward_backward_on_device(run.state.model, *tensors, *options, real)
    return loss_sum


def mean_token_loss(run: Run, plan: RunPlan, step: int, loss_sum: float) -> dict:
    """Fine-tuning's step loss: the summed token loss over the global batch's labelled tokens."""
    return {"loss": loss_sum / run.data.labels_in_step(step)}


def token_validation(run: Run, plan: RunPlan) -> dict:
    """Fine-tuning's validation: the mean token loss on the held-out rows (``val_loss``, and a
    mixture's per source)."""
    return validation_losses(run, plan.train.loss_chunk_tokens)


def finetune_steps(run: Run, plan: RunPlan) -> RecipeSteps:
    """Fine-tuning's step function (with pp the rank's pipeline), loss metric and validation."""
    step = run.pipeline or forward_backward_step
    return RecipeSteps(step=step, record=mean_token_loss, validate=token_validation)


def train_step(run: Run, plan: RunPlan, step: int, steps: RecipeSteps) -> dict:
    """One optimizer step (0-based ``step``): ``steps.step``'s forward and backward, gradient
    reductions, clip, update; its metrics, the loss's by ``steps.record`` from the step's sums.
    Reads the device twice: the replica sync, the readout."""
    started = time.perf_counter()
    reset_peak_memory(run.device)
    run.state.optimizer.zero_grad(set_to_none=True)
    tp_replicas.zero_tp_replica_gradients([run.state.model], run.meshes.world)  # into the buckets
    loss_sum = steps.step(run, plan, step)
    run.finalize_gradients([run.state.model])  # reads the device at the first step only
    tp_replicas.synchronize_tp_replica_gradients([run.state.model], run.meshes.world)  # in place
    clip, parts = plan.train.clip_grad_norm, [run.state.model]
    pp = run.pipeline and run.pipeline.group  # the grad norm's sum over the stages
    norm = clip_grad_norm_(parts, clip, across=pp) if clip else grad_norm(parts, across=pp)
    expert_counts = run.experts.end_step() if run.experts else None  # moves the routing bias
    stop = preemption.stop_requested() is not None  # agreed with the writer's flags, read once
    norm, loss_sum, peak, expert_rows = run.readout.read(norm, loss_sum, stop, expert_counts)
    finite = math.isfinite(norm)  # the same number on every rank, so all ranks decide alike
    if not finite and plan.train.on_nonfinite == "stop":
        raise FloatingPointError(
            f"step {step + 1}: grad norm is {norm}; stopped before the update "
            "(train.on_nonfinite=skip skips it)"
        )
    lr = float(run.state.schedule.get_last_lr()[0])  # torchao's optimizers: a host tensor
    if finite:
        run.state.optimizer.step()
    run.state.schedule.step()
    if run.pipeline is not None:  # a tied embedding's two stages
        run.pipeline.after_update()
    run.readout.after_update()  # the update's peak memory joins the next step's
    elapsed, tokens = time.perf_counter() - started, run.data.tokens_in_step(step)
    world, kind = dist.get_world_size(), matmul_math(plan.train.precision, plan.train.tf32)
    return {
        "step": step + 1,
        **steps.record(run, plan, step, loss_sum),
        "grad_norm": norm if finite else None,
        "lr": lr,
        "tokens": tokens,
        **throughput(tokens, elapsed, plan.flops_per_token, world, run.device, kind),  # MFU: kind's
        "peak_memory_gib": peak,
        **(load_metrics(expert_rows, plan.moe.expert_load == "experts") if run.experts else {}),
        **({} if finite else {"skipped": True}),
    }


def train(run: Run, plan: RunPlan, steps: RecipeSteps) -> tuple[str | None, int]:
    """The steps after ``run.first_step`` up to ``max_steps`` (or ``stop_after``) by the recipe's
    ``steps``: metrics, and validation, checkpoints and replica checks as the cadence says. Returns
    the name of the signal that stopped the run early (with a checkpoint of its step), or None; and
    how many steps were skipped as non-finite."""
    log, tracker, writer = open_outputs(run, plan)
    run.readout.writer = writer  # its stop and save flags are read with each step's values
    state, cadence, stopped, skipped = run.state, plan.cadence, None, 0
    profile = plan.settings.profile
    profiler = StepProfiler(profile.steps, profile.memory, plan.output_dir, run.rank, state.step)
    compiled = CompileCounts.start(say if plan.model.compile else None)  # Dynamo's, in the steps
    for step in cadence.steps(run.first_step):
        with heartbeat.watched(f"step {step + 1}", judged=step > run.first_step):  # 1st: compile
            with compiled.step(step + 1):  # a graph break, a recompilation: a note: line, once
                record = train_step(run, plan, step, steps) | writer.take_stall()  # save before
        state.step, skipped = step + 1, skipped + bool(record.get("skipped"))
        if cadence.validate(state.step):
            record |= steps.validate(run, plan)
        log.log(record)
        tracker.log_metrics(record, record["step"])
        if cadence.check_replicas(state.step):
            check_replicas([state.model], run.meshes.world, state.step)
        if cadence.save(state.step):
            writer.save(state)
        if (stopped := stop_signal(writer, state)) is not None:
            break
        profiler.step(state.step)  # ProfilerStep#N: all the loop does for the step
    at_stop = cadence.save_at_stop(run.first_step, state.step)  # stop_after's, a resume's end
    if stopped is None and at_stop and writer.last_step != state.step:
        writer.save(state)
    for output in (profiler, writer, log, tracker):  # the writer once its last save is published
        output.close()
    if stopped is not None:
        note = stop_note(stopped, state.step, plan.train.max_steps, writer.last_path)
        say(note, file=sys.stderr, flush=True)
    return stopped, skipped


def open_outputs(run: Run, plan: RunPlan) -> tuple[MetricsLog, MetricsLogger, CheckpointWriter]:
    """metrics.jsonl, the tracker (``logger=...``, on rank 0 only) and the checkpoint writer."""
    first, zero, logger, output_dir = run.first_step, run.rank == 0, plan.logger, plan.output_dir
    log = MetricsLog(output_dir / "metrics.jsonl", zero, first, plan.train.max_steps)
    hparams = yaml.safe_load(plan.config_yaml)
    tracker = open_logger(logger.target, logger.options(), output_dir, first, hparams, zero)
    saves = dict(keep=plan.checkpoint.keep, asynchronous=plan.checkpoint.asynchronous)
    ids = dict(run_id=plan.run_id, run_info=plan.run_info, before_commit=run.before_commit)
    return log, tracker, CheckpointWriter(plan.checkpoints, **saves, **ids)


def finish(run: Run, plan: RunPlan, stopped: bool = False, skipped: int = 0) -> None:
    """The replica drift report (any drift stops the run before export), the export and the loss
    curve; after a stop signal (``stopped``) only the loss curve: the run is to be resumed, and soon
    killed. Too many steps ``skipped`` as non-finite: no export, and one ``error:`` line."""
    output_dir, train = plan.output_dir, plan.train
    if not stopped:
        drift = output_dir / "replica_drift.json"
        write_drift_report([run.state.model], run.meshes.world, drift, run.rank)
    ended = (train.stop_after or train.max_steps) >= train.max_steps and not stopped
    fails, note = skipped_verdict(0 if stopped else skipped, plan.last_step - run.first_step)
    if plan.checkpoint.export and ended and not fails:
        export(run.state.model, plan, run.pipeline and run.pipeline.group)
    if run.rank == 0 and (output_dir / "metrics.jsonl").exists():
        plot_loss_curve(output_dir / "metrics.jsonl", output_dir / "loss.png", plan.title)
        if note and not fails:
            say(note, file=sys.stderr)
        if not fails:
            exported = plan.checkpoint.export and ended
            say(done_line(output_dir, train.max_steps, ended, exported, export_folders(plan)))
    dist.destroy_process_group()
    if fails:
        fail_once(note)  # every rank exits 1; rank 0 prints the one error: line


def rank_main(plan: RunPlan, steps: StepsOf = finetune_steps) -> str | None:
    """What every rank runs, beating: set up, train, finish; the stop signal's name (``train``).
    A local rank restarted after a failure resumes from the last complete checkpoint. ``steps``:
    the recipe's steps for the rank's run (fine-tuning's; DPO's; distillation's)."""
    if attempt := local_restart():
        plan = resume_again(plan, attempt)
    preemption.install()  # a SIGTERM or SIGUSR1 from now on stops the run after a step
    beating = heartbeat.beating(plan.settings.hang_timeout_s)  # watched: launcher or torchrun peers
    with beating, disk_full_said_plainly(plan.output_dir, plan.train.max_steps):  # one line
        run = set_up(plan)
        stopped, skipped = train(run, plan, steps(run, plan))
        finish(run, plan, stopped is not None, skipped)
    return stopped
