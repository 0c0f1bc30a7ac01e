"""Recipe overhead: tokens/s of ``recipes/finetune.py`` at tp=1 against a minimal hand-written PyTorch loop.

Why: the recipe adds a launcher, a process group, a mesh, ``loss_parallel``, DTensor gradient finalisation,
replica sync, a global grad norm and a metrics log around every step. At tp=1 all of that should cost
(almost) nothing: the goal is ≥ 0.95× the tokens/s of the plain loop on the same model and batches. The time
from launching the command to its first metrics line (start-up: interpreter, imports, tokenizer, model,
first step) is reported too.

Both sides train the tiny Llama (``tiny_config("llama", vocab_size=384)``, seed 0) on the recipe's default
data: 4,000 generated examples, the same 2 % validation split, the byte-level BPE trained on the same texts,
``StepBatches`` with global batch 16, micro-batch 8, seq_len 48, AdamW (lr 3e-3, betas 0.9/0.95), grad
clipping at 1.0 and the same warmup-cosine schedule. Tokens/s is the recipe's own formula
(``global_batch_size × seq_len / step time``), median over the steps after the first ``WARMUP_STEPS``.
Both run as fresh subprocesses with the same thread count (the recipe gives its single rank all cores, and
so does the loop): the recipe with ``train.val_every=0 checkpoint.export=false``, the loop as
``bench/recipe_overhead.py --hand-loop``, which writes one JSON line per step like ``metrics.jsonl``. They
alternate ``ROUNDS`` times, so a neighbour's load hits both alike. Start-up is measured the same way for both:
launch to the first line in the per-step file.

The Hugging Face ``Trainer`` is not compared: it needs ``accelerate``, which the project does not install.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from components.data import StepBatches, generate_examples, split_train_val, train_tokenizer, training_texts
from components.data.tokenizer import DEFAULT_VOCAB_SIZE
from components.models import build_causal_lm, tiny_config
from components.training.schedule import warmup_cosine

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
WARMUP_STEPS = 5
ROUNDS = 3
RATIO_GOAL = 0.95
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, SEED = 16, 8, 48, 0


def timed_command(command: list[str], metrics: Path) -> tuple[list[float], float, float]:
    """Run a command that writes one JSON line per step to ``metrics``; return per-step tokens/s, seconds from
    launch to the first line, and seconds for the whole command."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_line = None
    while process.poll() is None:
        if first_line is None and metrics.exists() and metrics.stat().st_size > 0:
            first_line = time.perf_counter() - started
        time.sleep(0.02)
    total = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{command[1]} failed ({process.returncode}): {process.stderr.read()[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["tokens_per_s"] for r in records], first_line or total, total


def recipe_command(output_dir: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO / "recipes" / "finetune.py"),
        f"output_dir={output_dir}",
        f"train.max_steps={STEPS}",
        "train.val_every=0",
        "checkpoint.export=false",
    ]


def hand_loop_command(tokenizer_dir: Path, metrics: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--hand-loop", str(tokenizer_dir), str(metrics)]


def hand_loop_main(tokenizer_dir: Path, metrics: Path) -> None:
    """The loop's own process: build the data like the recipe does, train, write one JSON line per step."""
    from transformers import AutoTokenizer

    records = generate_examples(4000, SEED)
    train, _ = split_train_val(records, 0.02, SEED)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batches = StepBatches(
        train, GLOBAL_BATCH, MICRO_BATCH, tokenizer=tokenizer, seq_len=SEQ_LEN, dp_size=1, dp_rank=0, seed=SEED
    )
    with metrics.open("w") as log:
        for speed in hand_loop(batches):
            log.write(json.dumps({"tokens_per_s": speed}) + "\n")
            log.flush()


def hand_loop(batches: StepBatches) -> Iterator[float]:
    """The plain PyTorch loop: forward, summed cross entropy / tokens, backward, clip, AdamW; tokens/s per step.

    Threads: all cores, as the recipe gives its single rank (``cores // local ranks``)."""
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_causal_lm(tiny_config("llama", vocab_size=DEFAULT_VOCAB_SIZE), seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = warmup_cosine(optimizer, 5, STEPS, 0.1)
    for step in range(STEPS):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        tokens = batches.tokens_in_step(step)
        loss_sum = 0.0
        for input_ids, labels in batches.batches_for_step(step):
            logits = model(input_ids=input_ids).logits
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
            )
            (loss / tokens).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        yield GLOBAL_BATCH * SEQ_LEN / (time.perf_counter() - started)


def _each(values: list[float], digits: int = 1) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def run() -> list[str]:
    """Alternate the recipe and the loop; print the table and the goal line; return the goal lines."""
    records = generate_examples(4000, SEED)
    train, _ = split_train_val(records, 0.02, SEED)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        train_tokenizer(training_texts(records), DEFAULT_VOCAB_SIZE, tokenizer_dir)
        speeds: dict[str, list[float]] = {"loop": [], "recipe": []}
        startups: dict[str, list[float]] = {"loop": [], "recipe": []}
        totals: dict[str, list[float]] = {"loop": [], "recipe": []}
        per_round: dict[str, list[float]] = {"loop": [], "recipe": []}
        for round_index in range(ROUNDS):
            run_dir = Path(tmp) / f"run{round_index}"
            run_dir.mkdir()
            commands = {
                "loop": (hand_loop_command(tokenizer_dir, run_dir / "loop.jsonl"), run_dir / "loop.jsonl"),
                "recipe": (recipe_command(run_dir), run_dir / "metrics.jsonl"),
            }
            for name in sorted(commands, reverse=bool(round_index % 2)):
                step_speeds, startup, total = timed_command(*commands[name])
                speeds[name] += step_speeds[WARMUP_STEPS:]
                per_round[name].append(statistics.median(step_speeds[WARMUP_STEPS:]))
                startups[name].append(startup)
                totals[name].append(total)
    recipe, loop = statistics.median(speeds["recipe"]), statistics.median(speeds["loop"])
    ratio = recipe / loop
    lines = [
        "### Recipe overhead at tp=1 (tiny Llama, CPU)",
        "",
        f"{ROUNDS} alternated rounds of {STEPS} steps each; median tokens/s over steps {WARMUP_STEPS + 1}..{STEPS}.",
        "",
        "| runner | median tokens/s | × hand loop | per round tokens/s | start-up to first step line s "
        "| whole command s |",
        "|---|---|---|---|---|---|",
        f"| hand-written loop (`bench/recipe_overhead.py --hand-loop`) | {loop:.0f} | 1.00 | "
        f"{_each(per_round['loop'], 0)} | {_each(startups['loop'])} | {_each(totals['loop'])} |",
        f"| `recipes/finetune.py` tp=1 | {recipe:.0f} | {ratio:.2f} | {_each(per_round['recipe'], 0)} | "
        f"{_each(startups['recipe'])} | {_each(totals['recipe'])} |",
    ]
    goals = [f"{'PASS' if ratio >= RATIO_GOAL else 'MISS'} recipe_overhead: {ratio:.2f}× (goal ≥ {RATIO_GOAL}×)"]
    print("\n".join(lines + [""] + goals), flush=True)
    return goals


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hand-loop"]:
        hand_loop_main(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        run()
