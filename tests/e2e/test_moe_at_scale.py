"""MoE at scale through the real command line: experts over data-parallel ranks train the model one
process trains.

Qwen3-MoE at ``tp=2 ep=4 dp=2`` (experts reached by all-to-all across dp ranks), 4 steps of SGD (lr
0.5) and of AdamW, fp32, against the same model on one process, and the resume of its checkpoint at
``tp=1 ep=2 dp=2``; under ``-m sweep`` also Qwen3-MoE at ``tp=1 ep=2 dp=2`` and ``tp=2 ep=2 dp=2``
(folded onto TP) and Mixtral at ``tp=2 ep=4 dp=2``. Only the order of floating-point sums differs:
loss and grad norm agree to ~1e-7 relative (measured worst 1.4e-7; asserted at 1e-5, the issue's
band). Clipping stays at 1.0: unclipped, SGD at lr 0.5 diverges by step 4 (loss 5.9 -> 8.3) and
amplifies the sum-order differences to 9e-6. Every step compares every replicated tensor across
its copies (``debug.check_replicas_every=1``: TP replicas, the experts' ``ep_shard`` copies), which
must stay bitwise equal or the run stops. The runs are Hydra sweeps (``--multirun``: one launcher
per sweep), only those of the selected cases.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests import cli
from tests.selection import is_selected, selected_params

# the module fixture's sweeps (4-rank runs) count against the first test: minutes when a second
# pytest worker shares the 2 cores and the cache starts empty
pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
COMMON = [
    f"train.max_steps={STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",  # 2 micro-batches per dp rank: accumulation runs too
    "train.val_every=0",
    "train.warmup_steps=0",
    "schedule=constant_with_warmup",
    "checkpoint.export=false",
    "data.num_examples=200",
    "debug.check_replicas_every=1",
]
OPTIMIZERS = {"sgd": ["optim=sgd", "optim.lr=0.5"], "adamw": ["optim=adamw"]}
# (model, tp, ep, dp) of the runs the issue asks for: the sweeps below run the selected ones and
# their one-process references, no more. The first (TP inside, experts dispatched across dp ranks;
# the resume test reads it) runs in make test; the others take the same recipe path to the other
# dispatch modes and Mixtral (tests/distributed/test_moe.py proves each in-process): -m sweep.
WRITTEN = ("qwen3_moe", 2, 4, 2)
SHAPES = [
    WRITTEN,
    pytest.param(("qwen3_moe", 1, 2, 2), marks=pytest.mark.sweep),
    pytest.param(("qwen3_moe", 2, 2, 2), marks=pytest.mark.sweep),
    pytest.param(("mixtral", 2, 4, 2), marks=pytest.mark.sweep),
]


def sweep(output_dir: Path, *overrides: str) -> dict[tuple, Path]:
    """Run one ``--multirun`` sweep; each job's folder by its (model, tp, ep, dp)."""
    command = [
        sys.executable,
        "recipes/finetune.py",
        "--multirun",
        *COMMON,
        f"output_dir={output_dir}",
        *overrides,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    jobs = {}
    for folder in sorted(path for path in output_dir.iterdir() if path.name.isdigit()):
        config = yaml.safe_load((folder / "config.yaml").read_text())
        jobs[(config["model"]["name"], config["tp"], config["ep"], config["dp"])] = folder
    return jobs


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def wanted_runs(request: pytest.FixtureRequest) -> dict[str, set[tuple]]:
    """The parallel runs this session's selected tests of this module read, by optimizer: the
    selected shapes for each selected optimizer, and the resume test's written run."""
    shapes = selected_params(request, "shape")
    wanted = {optimizer: set(shapes) for optimizer in selected_params(request, "optimizer")}
    if is_selected(request, test_a_checkpoint_written_at_tp2_ep4_dp2_resumes_at_tp1_ep2_dp2):
        wanted.setdefault("adamw", set()).add(WRITTEN)
    return wanted


def sweep_group(shape: tuple) -> tuple:
    """The (model, tp, dp) of a shape: shapes that share it run in one sweep over their ep."""
    model, tp, _, dp = shape
    return model, tp, dp


def optimizer_sweeps(output_dir: Path, optimizer: str, shapes: set[tuple]) -> dict[tuple, Path]:
    """The runs of ``shapes`` with ``optimizer`` and their one-process references: one sweep for
    the references, one per (model, tp, dp) over its ep values. AdamW's sweep of the written run
    saves checkpoints."""
    overrides = OPTIMIZERS[optimizer]
    models = ",".join(sorted({model for model, *_ in shapes}))
    jobs = sweep(output_dir / "one_process", f"model={models}", "tp=1", "ep=1", "dp=1", *overrides)
    for model, tp, dp in sorted({sweep_group(shape) for shape in shapes}):
        eps = sorted(shape[2] for shape in shapes if sweep_group(shape) == (model, tp, dp))
        written = optimizer == "adamw" and (model, tp, dp) == sweep_group(WRITTEN)
        save = ["checkpoint.every_steps=2"] if written else []
        layout = (f"model={model}", f"tp={tp}", f"dp={dp}", f"ep={','.join(map(str, eps))}")
        jobs |= sweep(output_dir / f"{model}_tp{tp}_dp{dp}", *layout, *overrides, *save)
    return jobs


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict[tuple, Path]]:
    root = tmp_path_factory.mktemp("moe")
    wanted = wanted_runs(request)
    return {name: optimizer_sweeps(root / name, name, shapes) for name, shapes in wanted.items()}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}_tp{s[1]}_ep{s[2]}_dp{s[3]}")
def test_experts_over_dp_ranks_match_one_process(runs, optimizer, shape):
    parallel = metrics(runs[optimizer][shape])
    one_process = metrics(runs[optimizer][(shape[0], 1, 1, 1)])
    assert [r["step"] for r in parallel] == list(range(1, STEPS + 1))
    for ours, theirs in zip(parallel, one_process, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert (
            ours["expert_imbalance"] == theirs["expert_imbalance"]
        )  # the same tokens reach the same experts
    assert parallel[0]["loss"] != parallel[-1]["loss"]  # it trained


def test_a_checkpoint_written_at_tp2_ep4_dp2_resumes_at_tp1_ep2_dp2(runs, tmp_path):
    written = runs["adamw"][WRITTEN]
    checkpoint = written / "checkpoints" / "step_00000002"
    command = [
        *(sys.executable, "recipes/finetune.py", *COMMON, *OPTIMIZERS["adamw"], "model=qwen3_moe"),
        *(
            "tp=1",
            "ep=2",
            "dp=2",
            f"checkpoint.resume={checkpoint}",
            f"output_dir={tmp_path / 'resumed'}",
        ),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, result.stderr[-4000:]
    resumed, uninterrupted = metrics(tmp_path / "resumed"), metrics(written)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, theirs in zip(resumed, uninterrupted[2:], strict=True):
        assert ours["lr"] == theirs["lr"]
        assert ours["loss"] == pytest.approx(
            theirs["loss"], rel=1e-6
        )  # other shape: only sum order differs
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)
