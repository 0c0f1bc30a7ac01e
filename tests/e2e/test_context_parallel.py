"""Context parallelism through the real command line: ``cp=2`` (and 4) trains what ``cp=1`` trains
(loss, grad norm and validation loss within 1e-5 relative over 4 fp32 steps) for llama at tp1/tp2,
qwen3 at tp2 with sp and at tp1 cp4, and packed llama at tp1 and tp2 with sp; a cp=2 checkpoint
resumes at cp=1 and a cp=1 one at cp=2 (DCP reshards: the weights are replicated over cp) and each
goes on as its cp=1 run did; an MoE model with cp > 1 is one ``error:`` line.

By default: the most composed layout with AdamW (qwen3 tp2 sp cp2), packed rows with SGD on 2 ranks
(packed cp2; packed rows at tp2 sp cp2 are tests/distributed/test_context_parallel.py's in make
test) and qwen3's cp=1 AdamW checkpoint resumed at cp=2. Under ``-m sweep``: plain cp2, packed tp2
sp cp2, tp2 cp2, cp4 and the resume at cp=1. The module fixture runs only the selected cases' runs.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests import cli
from tests.selection import selected_params

pytestmark = pytest.mark.timeout(600)  # the module fixture's runs count against the first test

REPO = Path(__file__).resolve().parents[2]
COMMON = ["train.max_steps=4", "train.warmup_steps=1", "train.val_every=4", "data.num_examples=200"]
COMMON += ["checkpoint.export=false", "train.global_batch_size=8", "train.micro_batch_size=4"]
RUNS = {
    "cp1": ["checkpoint.every_steps=2"],
    "cp2": ["cp=2", "checkpoint.every_steps=2"],
    "packed_cp1": ["train.packing=true", "optim=sgd", "optim.lr=0.5"],
    "packed_cp2": ["train.packing=true", "optim=sgd", "optim.lr=0.5", "cp=2"],
    "tp2_cp2": ["tp=2", "cp=2"],
    "qwen3_tp2_sp_cp2": ["model=qwen3", "tp=2", "sp=true", "cp=2"],
    "qwen3_cp1": ["model=qwen3", "checkpoint.every_steps=2"],
    "qwen3_cp4": ["model=qwen3", "cp=4"],
    "packed_tp2_sp_cp2": ["train.packing=true", "optim=sgd", "optim.lr=0.5", "tp=2", "sp=true"]
    + ["cp=2"],
}
# Each cp > 1 run and its twin: the same run on one process (tp=2 trains what tp=1 does to ~1e-7,
# tests/distributed/test_tp_parity.py and the regression recipes, far inside the band).
TWINS = {
    "cp2": "cp1",
    "packed_cp2": "packed_cp1",
    "tp2_cp2": "cp1",
    "qwen3_tp2_sp_cp2": "qwen3_cp1",
    "qwen3_cp4": "qwen3_cp1",
    "packed_tp2_sp_cp2": "packed_cp1",
}
SWEEP = ("cp2", "packed_tp2_sp_cp2", "tp2_cp2", "qwen3_cp4")  # the paths of the others again
# Each resumed run: (the run whose step-2 checkpoint it resumes, its overrides, the cp=1 run whose
# steps 3 and 4 are its reference).
RESUMES = {
    "resumed_cp1": ("cp2", ["cp=1"], "cp1"),
    "resumed_cp2": ("qwen3_cp1", ["model=qwen3", "cp=2"], "qwen3_cp1"),
}


def recipe(output_dir: Path, *overrides: str, ok: bool = True):
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={output_dir}"]
    command += list(overrides)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment
    )
    if not ok:
        return result
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-3000:]}"
    config = yaml.safe_load((output_dir / "config.yaml").read_text())
    layout = {key: config[key] for key in ("tp", "cp", "sp")}
    asked = dict(
        override.split("=") for override in overrides if override[:3] in ("tp=", "cp=", "sp=")
    )
    assert {key: str(layout[key]).lower() for key in asked} == asked, layout
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """The selected tests' runs once, two at a time, then the selected resumes of a cp run's
    step-2 checkpoint at the other cp."""
    root = tmp_path_factory.mktemp("cp")
    twins = selected_params(request, "name")
    resumes = selected_params(request, "resumed")
    needed = {*twins, *(TWINS[name] for name in twins)}
    needed |= {run for name in resumes for run in (RESUMES[name][0], RESUMES[name][2])}
    names = [name for name in RUNS if name in needed]
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda name: recipe(root / name, *RUNS[name]), names)
        done = dict(zip(names, results, strict=True))

        def resume(name: str) -> list[dict]:
            source, overrides, _ = RESUMES[name]
            checkpoint = root / source / "checkpoints" / "step_00000002"
            return recipe(root / name, *overrides, f"checkpoint.resume={checkpoint}")

        done |= dict(zip(resumes, pool.map(resume, resumes), strict=True))
    return done


def worst_gap(ours: list[dict], theirs: list[dict]) -> float:
    keys = ("loss", "grad_norm", "val_loss")
    return max(
        abs(a[key] - b[key]) / abs(b[key])
        for a, b in zip(ours, theirs, strict=True)
        for key in keys
        if key in b
    )


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.sweep) if name in SWEEP else name for name in TWINS],
)
def test_cp_trains_what_cp1_trains(runs, name):
    reference = runs[TWINS[name]]
    assert [record["step"] for record in runs[name]] == [1, 2, 3, 4]
    assert "val_loss" in runs[name][-1]
    print(f"{name}: worst gap {worst_gap(runs[name], reference):.1e}")
    assert worst_gap(runs[name], reference) <= 1e-5


@pytest.mark.parametrize(
    "resumed", [pytest.param("resumed_cp1", marks=pytest.mark.sweep), "resumed_cp2"]
)
def test_a_checkpoint_resumes_at_the_other_cp(runs, resumed):
    curve, reference = runs[resumed], runs[RESUMES[resumed][2]][2:]
    assert [record["step"] for record in curve] == [3, 4]
    print(f"{resumed}: worst gap {worst_gap(curve, reference):.1e}")
    assert worst_gap(curve, reference) <= 1e-5


def test_moe_with_cp_is_one_error_line(tmp_path):
    result = recipe(tmp_path / "moe", "model=qwen3_moe", "cp=2", ok=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "cp=2 with an MoE model" in lines[0]
    assert "not supported yet" in lines[0]
