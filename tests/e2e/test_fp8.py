"""FP8 (``train.precision=fp8``) through the real command line, on the tiny Llama (every dimension
a multiple of 16: hidden 64, MLP 128, q 64 and k/v 32 outputs, rows of 32 tokens): its loss curve
follows bf16-mixed's within 2e-2 relative at tp=1, at tp=2 with sp=true (torchao's
``Float8ColwiseParallel``; over gloo the plan's other styles stay plain under sp, see
components/distributed/float8_tp.py) and at dp=2 (FSDP2 all-gathering the float8 weights, their
scales precomputed, with activation checkpointing); tp=2 equals tp=1 within 1e-2; the rowwise
recipe likewise. The bands are the issue's.

10 steps, not the issue's 30: the six runs must add ~20 s to a suite at its 10-minute limit, and
each step at tp=2 costs more than the run's start. Measured at 10 steps: worst gaps to bf16-mixed
7.8e-4 (tp=1), 6.0e-4 (tp=2 sp), 1.0e-3 (dp=2), 5.9e-4 and 8.1e-4 (rowwise tp=1, tp=2 sp); tp=2
against tp=1 6.0e-4 (rowwise 3.1e-4). The same command lines at 30 steps, run by hand: at most
1.7e-3 and 1.3e-3 (docs/precision-and-memory.md, with the issue's 256-wide shape's figures).
"""

import json
import os
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import cli

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
COMMON = [
    f"train.max_steps={STEPS}",
    "train.warmup_steps=2",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


def finetune(output_dir: Path, *overrides: str, sweep: bool = False) -> None:
    """One run, or with ``sweep`` one ``--multirun`` sweep (its jobs in output_dir/0, /1, ...)."""
    flags = ["--multirun"] if sweep else []
    command = [sys.executable, "recipes/finetune.py", *flags, *COMMON, *overrides]
    command.append(f"output_dir={output_dir}")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    # torchao's import lines on a CPU build, dropped by components/__init__.py
    assert "torchao/_C" not in result.stderr and "Enum subclass" not in result.stderr


def losses(folder: Path) -> list[float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines)]


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, list[float]]:
    """Six curves from three commands: both recipes at tp 1 and 2 (one sweep), bf16-mixed, fp8 at
    dp=2."""
    root = tmp_path_factory.mktemp("fp8")
    recipes = ["train.precision=fp8", "train.fp8_recipe=tensorwise,rowwise", "tp=1,2", "sp=true"]
    finetune(root / "mixed", "train.precision=bf16-mixed")
    finetune(root / "tp", *recipes, sweep=True)
    finetune(
        root / "dp2",
        "dp=2",
        "train.micro_batch_size=4",
        "train.precision=fp8",
        "train.activation_checkpointing=full",
    )
    found = {}
    for job in (root / "tp").glob("[0-9]"):  # named by the config each job saved
        config = OmegaConf.load(job / "config.yaml")
        name = {"tensorwise": "fp8", "rowwise": "rowwise"}[config.train.fp8_recipe]
        found[f"{name}_tp1" if config.tp == 1 else f"{name}_tp2_sp"] = losses(job)
    assert len(found) == 4
    return found | {"mixed_tp1": losses(root / "mixed"), "fp8_dp2": losses(root / "dp2")}


def worst_gap(ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    "name", ["fp8_tp1", "fp8_tp2_sp", "fp8_dp2", "rowwise_tp1", "rowwise_tp2_sp"]
)
def test_fp8_follows_bf16_mixed(curves, name):
    gap = worst_gap(curves[name], curves["mixed_tp1"])
    print(f"{name} vs bf16-mixed: worst loss gap {gap:.2e}")
    assert 0 < gap <= 2e-2  # not 0: the run really computed in fp8


@pytest.mark.parametrize("recipe", ["fp8", "rowwise"])
def test_fp8_at_tp2_equals_tp1(curves, recipe):
    gap = worst_gap(curves[f"{recipe}_tp2_sp"], curves[f"{recipe}_tp1"])
    print(f"{recipe} tp=2 sp vs tp=1: worst loss gap {gap:.2e}")
    assert gap <= 1e-2


def test_the_loss_falls(curves):
    assert curves["fp8_tp1"][-1] < 0.85 * curves["fp8_tp1"][0]  # 5.95 to 4.77 measured
