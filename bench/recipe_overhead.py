"""Step overhead at tp=1: the recipe's step components against a bare PyTorch loop and Hugging Face
``Trainer``.

Why: at tp=1 the recipe's bookkeeping around a step (``loss_parallel``, DTensor gradient
finalisation, replica sync, a global grad norm and clipping) should cost almost nothing: the goals
are ≥ 0.97× the bare loop's tokens/s and at least HF ``Trainer``'s. And the threads per rank:
``cores // local ranks`` or one thread, which default pays?

Three runners train the same tiny Llama (``tiny_config("llama", vocab_size=384)``, seed 0) on the
same token batches (global batch 16 = 2 micro-batches of 8, seq_len 48, seeded random tokens: no
data pipeline, so only the step is compared), AdamW (lr 3e-3, betas 0.9/0.95, no weight decay),
clipping at 1.0 and the recipe's warmup-cosine schedule:

- ``loop``: forward, summed cross entropy / tokens, backward, ``torch.nn.utils.clip_grad_norm_``,
  step.
- ``recipe``: the recipe's step components on a one-rank gloo group and a ("dp", "tp") mesh of 1 × 1
  (created for the run: with a process group alive, ``Trainer`` would wrap its model in DDP):
  ``forward_backward`` (``loss_parallel``), ``finalize_dtensor_gradients``,
  ``synchronize_tp_replica_gradients``, ``clip_grad_norm_`` of ``components.distributed.grads``,
  step.
- ``hf_trainer``: ``transformers.Trainer`` (``max_grad_norm=1.0``,
  ``gradient_accumulation_steps=2``, each micro-batch one dataset item taken in order, the same
  optimizer and scheduler objects, no logging or saving); its per-step times are the intervals
  between a ``TrainerCallback``'s ``on_step_end`` calls.

They alternate in one process (``ROUNDS`` rounds, each a fresh model per runner, the order rotated),
for 1 and 2 threads; tokens/s is ``16 × 48 / step time``, median over the steps after
``WARMUP_STEPS``. ``loop``, ``hf_trainer`` and :func:`alternate` take any :class:`Workload`:
``bench/smollm2_overhead.py`` runs them on SmolLM2-135M beside the recipe's own training loop.
"""

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from components.distributed.grads import clip_grad_norm_, finalize_dtensor_gradients
from components.distributed.tp_replicas import synchronize_tp_replica_gradients
from components.models import build_causal_lm
from components.runtime.launch import free_port
from components.training.schedule import warmup_cosine
from components.training.step import forward_backward
from recipes.tiny_models import tiny_config

STEPS, WARMUP_STEPS, ROUNDS = 25, 5, 3
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, VOCAB, SEED = 16, 8, 48, 384, 0
RECIPE_GOAL, RUNNERS = 0.97, ("loop", "recipe", "hf_trainer")
IGNORE_INDEX = -100  # a label the loss skips (the recipe's and Hugging Face's)

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels), [rows, positions] each
Setup = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, object]]


@dataclass(kw_only=True)
class Workload:
    """What every runner trains: ``setup`` makes a fresh model, optimizer and schedule (the same
    weights at each call); ``steps`` holds each optimizer step's micro-batches; ``tokens`` is what
    tokens/s counts at each step; ``clip`` bounds the grad norm."""

    setup: Setup
    steps: list[list[MicroBatch]]
    tokens: list[int]
    clip: float


def _setup():
    model = build_causal_lm(tiny_config("llama", vocab_size=VOCAB), seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    return model, optimizer, warmup_cosine(optimizer, 5, STEPS, 0.1)


def tiny_workload() -> Workload:
    """The tiny Llama on seeded random tokens, every position trained."""
    generator = torch.Generator().manual_seed(SEED)
    batches = [
        torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)
    ]
    steps = [[(rows, rows) for rows in batch.split(MICRO_BATCH)] for batch in batches]
    return Workload(setup=_setup, steps=steps, tokens=[GLOBAL_BATCH * SEQ_LEN] * STEPS, clip=1.0)


def _labelled(micro_batches: list[MicroBatch]) -> int:
    """Positions the step's loss counts: shifted labels that are not ``IGNORE_INDEX``."""
    return sum(int((labels[:, 1:] != IGNORE_INDEX).sum()) for _, labels in micro_batches)


def loop(work: Workload, losses: list[float] | None = None) -> list[float]:
    """A bare PyTorch loop: forward, summed cross entropy / labelled tokens, backward,
    ``torch.nn.utils.clip_grad_norm_``, step; each step's seconds. ``losses``, if given, gets each
    step's loss (bench/adamw4bit_loop.py)."""
    model, optimizer, scheduler = work.setup()
    times = []
    for micro_batches in work.steps:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        labelled, loss_sum = _labelled(micro_batches), 0.0
        for input_ids, labels in micro_batches:
            logits = model(input_ids=input_ids).logits
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum"
            )
            (loss / labelled).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), work.clip)
        optimizer.step()
        scheduler.step()
        times.append(time.perf_counter() - started)
        if losses is not None:
            losses.append(loss_sum / labelled)
    return times


def recipe(work: Workload) -> list[float]:
    """The recipe's components on a one-rank gloo group, created for this run only (so that
    ``Trainer``, run without a process group, does not wrap its model in
    DistributedDataParallel)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        return _recipe_steps(work, init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")))
    finally:
        dist.destroy_process_group()


def _recipe_steps(work: Workload, mesh) -> list[float]:
    model, optimizer, scheduler = work.setup()
    times = []
    for micro_batches in work.steps:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        labelled = _labelled(micro_batches)
        for input_ids, labels in micro_batches:
            forward_backward(model, input_ids, labels, labelled)
        finalize_dtensor_gradients([model])
        synchronize_tp_replica_gradients([model], mesh)
        clip_grad_norm_([model], work.clip).item()
        optimizer.step()
        scheduler.step()
        times.append(time.perf_counter() - started)
    return times


def hf_trainer(work: Workload) -> list[float]:
    """``transformers.Trainer`` on the same micro-batches in the same order (one dataset item per
    micro-batch, a sequential sampler); each step's seconds."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, optimizer, scheduler = work.setup()
    items = [{"input_ids": ids, "labels": labels} for step in work.steps for ids, labels in step]
    times: list[float] = []

    class StepTimer(TrainerCallback):
        """Step time = from one optimizer step's end to the next's (``on_step_begin`` fires per
        micro-batch)."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    def collate(chosen: list[dict]) -> dict:
        return chosen[0]  # one item: a whole micro-batch

    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=len(work.steps[0]),
            train_sampling_strategy="sequential",
            max_steps=len(work.steps),
            max_grad_norm=work.clip,
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=SEED,
        )
        trainer = Trainer(
            model=model,
            args=arguments,
            train_dataset=items,
            data_collator=collate,
            optimizers=(optimizer, scheduler),
            callbacks=[StepTimer()],
        )
        trainer.train()
    return times


Runner = Callable[[Workload], list[float]]


def alternate(
    runners: dict[str, Runner], work: Workload, threads: int, rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Each runner's tokens/s at every step after ``warmup``, ``rounds`` rounds in one process at
    ``threads`` intra-op threads, the runners' order rotated each round."""
    torch.set_num_threads(threads)
    names = list(runners)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times = runners[name](work)
            torch.set_num_threads(threads)  # a runner may set its own (the recipe's join_world)
            pairs = list(zip(work.tokens, times, strict=True))[warmup:]
            speeds[name] += [tokens / seconds for tokens, seconds in pairs]
    return speeds


def _measure(threads_options: tuple[int, ...]) -> dict:
    work, runners = tiny_workload(), {name: globals()[name] for name in RUNNERS}
    results: dict = {}
    for threads in threads_options:
        speeds = alternate(runners, work, threads, ROUNDS, WARMUP_STEPS)
        results[threads] = {name: statistics.median(values) for name, values in speeds.items()}
    return results


def run(threads_options: tuple[int, ...] = (1, 2)) -> list[str]:
    """Alternate the three runners at each thread count; print the table and goal lines; return the
    goals."""
    load = [os.getloadavg()[0]]
    results = _measure(threads_options)
    load.append(os.getloadavg()[0])
    lines = [
        "### Step overhead at tp=1 (tiny Llama, CPU)",
        "",
        f"{ROUNDS} alternated rounds of {STEPS} steps per runner; median tokens/s over steps "
        f"{WARMUP_STEPS + 1}.."
        f"{STEPS}. Load average (1 min) {load[0]:.2f} at start, {load[1]:.2f} at end.",
        "",
        "| threads | runner | median tokens/s | × loop |",
        "|---|---|---|---|",
    ]
    goals = []
    for threads, speeds in results.items():
        for name in RUNNERS:
            lines.append(
                f"| {threads} | {name} | {speeds[name]:.0f} | {speeds[name] / speeds['loop']:.2f} |"
            )
        ratio = speeds["recipe"] / speeds["loop"]
        goals.append(
            f"{'PASS' if ratio >= RECIPE_GOAL else 'MISS'} recipe_overhead ({threads} thread(s)): "
            "recipe "
            f"{ratio:.2f}× the loop (goal ≥ {RECIPE_GOAL}×)"
        )
        versus = speeds["recipe"] / speeds["hf_trainer"]
        goals.append(
            f"{'PASS' if versus >= 1 else 'MISS'} recipe_overhead ({threads} thread(s)): recipe "
            f"{versus:.2f}× "
            "HF Trainer (goal ≥ 1×)"
        )
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


if __name__ == "__main__":
    run(tuple(int(a) for a in sys.argv[1:]) or (1, 2))
