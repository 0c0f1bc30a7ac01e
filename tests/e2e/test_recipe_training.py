"""The recipe as a user runs it: the real command line in a subprocess, compared across
parallelisms.

Runs share a module fixture so each configuration trains once. All fp32 on the CPU; tp changes only
the order of floating-point sums, so per-step losses agree to ~1e-7 relative (asserted at 1e-5).

By default the parity test runs tp=2 and dp=2 x tp=2 with sp (the most composed layout) against
tp=1, torchrun runs 2 ranks, and the resume continues at tp=2 and at tp=1 (another tp); tp=4's
parity is opt-in (``pytest -m sweep``): it proves the same sharding again on 4 ranks.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.data import GeneratedSource, StepBatches, prepare_data
from tests import cli
from tests.selection import selected_params

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(
    os.environ.get("SHARDTUNE_CACHE") or Path.home() / ".cache" / "shardtune"
)  # the recipe's cache_dir
STEPS = 6
# Small and quick: 6 steps of 8 sequences, 2 micro-batches per dp rank (gradient accumulation
# exercised).
COMMON = [
    f"train.max_steps={STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=400",
]


def recipe(
    output_dir: Path, *overrides: str, torchrun: int = 0, script: str = "recipes/finetune.py"
) -> list[dict]:
    """``script`` (a recipe sharing finetune.py's keys) run with :data:`COMMON` and
    ``overrides`` into ``output_dir``; its metrics, one record per step."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    command = [*launcher, script, *COMMON, f"output_dir={output_dir}", *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    if torchrun:  # a real torchrun whose workers start warm
        environment = cli.warm_torchrun_environment(environment)
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    output_dir.with_suffix(".stdout").write_text(result.stdout)  # what a log of the run holds
    output_dir.with_suffix(".stderr").write_text(result.stderr)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> list[float]:
    return [record["loss"] for record in records]


RUNS = {
    "tp1": ["tp=1"],
    "tp2": ["tp=2", "checkpoint.export=true", "train.val_every=6"],
    "tp4": ["tp=4"],
    "dp2_tp2_sp": ["tp=2", "dp=2", "sp=true"],
}
ALWAYS = ("tp1", "tp2")  # the reference and the run the other tests read


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Path]:
    """The runs of :data:`ALWAYS` and of the parity cases this session selected, once each."""
    root = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, overrides in RUNS.items():
        if name in ALWAYS or name in selected_params(request, "name"):
            paths[name] = root / name
            recipe(paths[name], *overrides)
    return paths


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_metrics_have_one_line_per_step_with_the_contract_fields(runs):
    records = metrics(runs["tp2"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s"} <= record.keys()
    assert "val_loss" in records[-1]
    title = Image.open(runs["tp2"] / "loss.png").info["Title"]  # and its curves (unit test)
    assert title == f"llama, tp=2, {STEPS} steps: tp2"


def test_a_logged_run_prints_a_line_per_step_and_ends_with_its_summary(runs):
    """stdout is a file here, as in a log: no progress bar, a plain line per step, a summary of
    what metrics.jsonl holds, then the done line naming the folder. stderr holds nothing: no bar,
    no import noise (torchao's kernels, torch's pytree notes: tests/unit/test_quiet_imports.py)."""
    assert runs["tp2"].with_suffix(".stderr").read_text() == ""
    records, lines = metrics(runs["tp2"]), runs["tp2"].with_suffix(".stdout").read_text()
    lines = lines.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[:4] for line in steps] == [
        ["step", str(r["step"]), "loss", f"{r['loss']:.4f}"] for r in records
    ]
    (summary,), done = [line for line in lines if line.startswith("summary: ")], lines[-1]
    tokens = sum(record["tokens"] for record in records)
    assert summary.startswith(f"summary: steps 1-{STEPS} of {STEPS}, {tokens:,} tokens in ")
    last = records[-1]["val_loss"]  # validated once, at the last step
    assert summary.endswith(
        f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; val_loss {last:.4f} at step "
        f"{STEPS}, best {last:.4f} at step {STEPS}"
    )
    assert done == f"done: metrics, loss.png and hf/ in {runs['tp2']}"


@pytest.mark.parametrize(
    "name", ["tp2", pytest.param("tp4", marks=pytest.mark.sweep), "dp2_tp2_sp"]
)
def test_parallel_runs_match_tp1_step_by_step(runs, name):
    reference = metrics(runs["tp1"])
    for ours, theirs in zip(metrics(runs[name]), reference, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


def test_torchrun_gives_the_same_losses(runs, tmp_path):
    records = recipe(tmp_path / "torchrun", "tp=2", torchrun=2)
    assert losses(records) == pytest.approx(losses(metrics(runs["tp2"])), rel=1e-6)


def test_resume_reproduces_the_uninterrupted_run_exactly(runs, tmp_path):
    interrupted = tmp_path / "interrupted"
    recipe(interrupted, "tp=2", "checkpoint.every_steps=3", "train.stop_after=3")
    assert len(metrics(interrupted)) == 3
    at_tp1 = tmp_path / "at_tp1"
    shutil.copytree(interrupted, at_tp1)

    resumed = recipe(interrupted, "tp=2", "checkpoint.resume=auto", "checkpoint.every_steps=3")
    uninterrupted = metrics(runs["tp2"])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert losses(resumed)[3:] == losses(uninterrupted)[3:]  # exact on the CPU
    assert [r["grad_norm"] for r in resumed][3:] == [r["grad_norm"] for r in uninterrupted][3:]
    # the same command again: the run is finished (its last checkpoint at max_steps), status 0
    assert recipe(interrupted, "tp=2", "checkpoint.resume=auto") == resumed  # its step 6 saved
    finished = f"note: checkpoint.resume=auto: the run in {interrupted} is already complete at step"
    assert f"{finished} {STEPS}: nothing to train" in interrupted.with_suffix(".stdout").read_text()
    # but a run that also wants hf/, which this one never wrote, is not done: refused, status 2
    command = ["recipes/finetune.py", *COMMON, f"output_dir={interrupted}", "tp=2"]
    command += ["checkpoint.resume=auto", "checkpoint.export=true"]
    result = cli.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "nothing to train" in result.stderr, result.stderr[-2000:]

    continued = recipe(at_tp1, "tp=1", "checkpoint.resume=auto")
    assert losses(continued)[3:] == pytest.approx(losses(uninterrupted)[3:], rel=1e-5)


def test_exported_folder_reloads_with_the_trained_weights(runs):
    folder = runs["tp2"] / "hf"
    model = AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)  # the export carries a loadable tokenizer
    # The final validation loss was computed on the trained (sharded) model after the last update,
    # on the validation rows the launcher prepared (the same cache entry serves this call).
    source = GeneratedSource(num_examples=400, val_fraction=0.02, seed=0)
    prepared = prepare_data(
        source,
        folder,
        seq_len=48,
        loss_on="all_assistant",
        packing=False,
        seed=0,
        cache_root=CACHE,
        num_proc=1,
    )
    batches = StepBatches.open(prepared.val, 4, 4, dp_size=1, dp_rank=0, seed=0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches.all_batches():
            logits = model(input_ids=batch.input_ids).logits[:, :-1].flatten(0, 1)
            total += torch.nn.functional.cross_entropy(
                logits, batch.labels[:, 1:].flatten(), reduction="sum"
            ).item()
            tokens += batch.labelled_tokens()
    assert total / tokens == pytest.approx(metrics(runs["tp2"])[-1]["val_loss"], rel=1e-5)
