"""FP8 (``train.precision=fp8``) through the real command line: 30 steps of a Llama whose every
dimension is a multiple of 16 (hidden 256, 4 layers, packed rows of 256 tokens) follow bf16-mixed's
loss curve within 2e-2 relative at tp=1, at tp=2 with sp=true (torchao's float8 TP styles) and at
dp=2 (FSDP2 with float8 all-gather and precomputed scales, and activation checkpointing); tp=2
equals tp=1 within 1e-2; the rowwise recipe likewise.

Measured (this machine, optim.lr=3e-4): worst per-step loss gap to bf16-mixed over the 30 steps
3.1e-3 (tp=1), 6.9e-3 (tp=2 sp), 3.8e-3 (dp=2), 2.1e-3 (rowwise); tp=2 against tp=1 3.8e-3 (rowwise
1.2e-3); the bands are the issue's, 2e-2 and 1e-2. At the default lr (3e-3) two sequences a step
make the run chaotic: bf16-mixed at dp=2 already strays 1.9e-2 from itself at dp=1, and fp8 (each
matmul ~4e-2 off, tests/unit/models/test_fp8.py) 5e-2 to 8e-2 after a dozen steps, in any layout.
On the CPU the float8 matmuls are torchao's emulation and the TP collectives bf16
(components/models/fp8.py, components/distributed/float8_tp.py).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import cli

pytestmark = pytest.mark.timeout(900)  # the module fixture's runs count against the first test

REPO = Path(__file__).resolve().parents[2]
SIZES = [
    "model.config.hidden_size=256",
    "model.config.num_hidden_layers=4",
    "model.config.intermediate_size=512",
    "model.config.head_dim=32",
]
COMMON = [
    *SIZES,
    "train.max_steps=30",
    "train.warmup_steps=3",
    "train.seq_len=256",
    "train.packing=true",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
    "optim.lr=3e-4",  # at the default 3e-3 two sequences a step make the run chaotic (see BANDS)
]


def finetune(output_dir: Path, *overrides: str, sweep: bool = False) -> None:
    """One run, or with ``sweep`` one ``--multirun`` sweep (its jobs in output_dir/0, /1, ...)."""
    flags = ["--multirun"] if sweep else []
    command = [sys.executable, "recipes/finetune.py", *flags, *COMMON, f"output_dir={output_dir}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        [*command, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=environment,
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"


def losses(folder: Path) -> list[float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines)]


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, list[float]]:
    """Five curves from three commands: fp8 at tp 1 and 2 (one sweep), bf16-mixed and rowwise fp8
    at tp=1 (one sweep; bf16-mixed reads no recipe), fp8 at dp=2 with activation checkpointing."""
    root = tmp_path_factory.mktemp("fp8")
    finetune(root / "tp", "tp=1,2", "sp=true", "train.precision=fp8", sweep=True)
    precisions = ["train.precision=bf16-mixed,fp8", "train.fp8_recipe=rowwise"]
    finetune(root / "tp1", *precisions, sweep=True)
    finetune(root / "dp2", "dp=2", "train.precision=fp8", "train.activation_checkpointing=full")
    found = {"fp8_tp1": losses(root / "tp" / "0"), "fp8_tp2_sp": losses(root / "tp" / "1")}
    found |= {"mixed_tp1": losses(root / "tp1" / "0"), "rowwise_tp1": losses(root / "tp1" / "1")}
    return found | {"fp8_dp2": losses(root / "dp2")}


def worst_gap(ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) == 30
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("name", ["fp8_tp1", "fp8_tp2_sp", "fp8_dp2", "rowwise_tp1"])
def test_fp8_follows_bf16_mixed(curves, name):
    gap = worst_gap(curves[name], curves["mixed_tp1"])
    print(f"{name} vs bf16-mixed: worst loss gap {gap:.2e}")
    assert 0 < gap <= 2e-2


def test_fp8_at_tp2_equals_tp1(curves):
    gap = worst_gap(curves["fp8_tp2_sp"], curves["fp8_tp1"])
    print(f"fp8 tp=2 vs tp=1: worst loss gap {gap:.2e}")
    assert gap <= 1e-2


def test_the_loss_falls(curves):
    assert curves["fp8_tp1"][-1] < 0.6 * curves["fp8_tp1"][0]
