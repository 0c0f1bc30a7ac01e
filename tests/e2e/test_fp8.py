"""FP8 (``train.precision=fp8``) through the real command line, on the tiny Llama (every dimension
a multiple of 16: hidden 64, MLP 128, q 64 and k/v 32 outputs, rows of 32 tokens): its loss curve
follows bf16-mixed's within 2e-2 relative at tp=1 and at tp=2 with sp=true (torchao's
``Float8ColwiseParallel``; over gloo the plan's other styles stay plain under sp, see
components/distributed/float8_tp.py), tp=2 equals tp=1 within 1e-2, and the rowwise recipe follows
at tp=1. The bands are the issue's. ``-m sweep`` adds dp=2 (FSDP2 all-gathering the float8 weights,
with activation checkpointing; its parity is tests/distributed/test_tp_parity.py's in make test)
and rowwise at tp=2 sp. 10 steps, not the issue's 30; measured at 10 steps: worst gaps to
bf16-mixed 7.8e-4 (tp=1), 6.0e-4 (tp=2 sp), 1.0e-3 (dp=2), 5.9e-4 and 8.1e-4 (rowwise tp=1, tp=2
sp); tp=2 against tp=1 6.0e-4 (rowwise 3.1e-4); at 30 steps by hand at most 1.7e-3 and 1.3e-3
(docs/precision-and-memory.md). A tp=2 sp run costs ~11 CPU-s: each fp8 step ~0.8 CPU-s against
~0.25 plain, torchao's dynamic scaling adding ~8 small DTensor ops per linear and pass (abs, max,
amax all-reduce, casts, clamp), sharding-propagated afresh on the first (27% of the ranks' samples).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import cli
from tests.selection import selected_params

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


def finetune(output_dir: Path, *overrides: str) -> list[float]:
    """One run's losses."""
    command = [sys.executable, "recipes/finetune.py", *COMMON, *overrides]
    command.append(f"output_dir={output_dir}")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    # torchao's import lines on a CPU build, dropped by components/__init__.py
    assert "torchao/_C" not in result.stderr and "Enum subclass" not in result.stderr
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines)]


FP8, SP = "train.precision=fp8", ["tp=2", "sp=true"]
ROWWISE = [FP8, "train.fp8_recipe=rowwise"]
RUNS = {
    "mixed_tp1": ["train.precision=bf16-mixed"],
    "fp8_tp1": [FP8],
    "fp8_tp2_sp": [FP8, *SP],
    "rowwise_tp1": ROWWISE,
    "rowwise_tp2_sp": [*ROWWISE, *SP],
    "fp8_dp2": [FP8, "dp=2", "train.micro_batch_size=4", "train.activation_checkpointing=full"],
}


@pytest.fixture(scope="module")
def curves(request, tmp_path_factory) -> dict[str, list[float]]:
    """The curves the selected tests compare; bf16-mixed's and fp8 at tp=1 always."""
    root = tmp_path_factory.mktemp("fp8")
    names = {"mixed_tp1", "fp8_tp1", *selected_params(request, "name")}
    for recipe in selected_params(request, "recipe"):
        names |= {f"{recipe}_tp1", f"{recipe}_tp2_sp"}
    return {name: finetune(root / name, *RUNS[name]) for name in RUNS if name in names}


def worst_gap(ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


SWEEP = pytest.mark.sweep  # each adds a run whose code path make test proves otherwise


@pytest.mark.parametrize(
    "name",
    [
        "fp8_tp1",
        "fp8_tp2_sp",
        "rowwise_tp1",
        pytest.param("fp8_dp2", marks=SWEEP),
        pytest.param("rowwise_tp2_sp", marks=SWEEP),
    ],
)
def test_fp8_follows_bf16_mixed(curves, name):
    gap = worst_gap(curves[name], curves["mixed_tp1"])
    print(f"{name} vs bf16-mixed: worst loss gap {gap:.2e}")
    assert 0 < gap <= 2e-2  # not 0: the run really computed in fp8


@pytest.mark.parametrize("recipe", ["fp8", pytest.param("rowwise", marks=SWEEP)])
def test_fp8_at_tp2_equals_tp1(curves, recipe):
    gap = worst_gap(curves[f"{recipe}_tp2_sp"], curves[f"{recipe}_tp1"])
    print(f"{recipe} tp=2 sp vs tp=1: worst loss gap {gap:.2e}")
    assert gap <= 1e-2


def test_the_loss_falls(curves):
    assert curves["fp8_tp1"][-1] < 0.85 * curves["fp8_tp1"][0]  # 5.95 to 4.77 measured
