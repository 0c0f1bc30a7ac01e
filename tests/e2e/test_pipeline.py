"""Pipeline parallelism through the real command line, each layout against its one-process twin,
fp32 on the CPU, losses and grad norms within 1e-5 relative over 4 steps (measured ~1e-7): pp=2
GPipe with SGD on a tiny Qwen3; pp=2 × dp=2 1F1B with AdamW (4 ranks), pp=4 1F1B with SGD (one
stage per rank, the embedding and the head each on a stage of one layer), pp=2 interleaved with 2
stages per rank, pp=2 × tp=2 with sp (4 ranks), pp=2 with peft=lora and pp=2 GPipe with SGD and
tied embeddings on a tiny Llama of 4 layers, each with validation every 2 steps (its val_loss the
twin's too); checkpoints across layouts with AdamW and with SGD, pp=2 (× dp=2) → one process and
one process → pp=2 × tp=2; and the Hugging Face export of a pipelined run holds the same tensors
as its twin's.

The runs are made once (a module fixture) and shared by the tests; the fixture makes only the
selected tests' runs. By default the SGD resume and export come from the tied GPipe run; Qwen3's
GPipe run (its export and SGD resume too: the same schedule on a family the pipeline treats as
Llama), pp=4 and the resumes into pp=2 × tp=2 (4 ranks each; pp=4's four stages are
interleaved's, pp × tp is tp_sp's) run under ``-m sweep``.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import cli
from tests.selection import selected_params

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",  # 4 micro-batches per step, per dp rank: the pipeline's
    "train.val_every=2",  # validation through the stages
    "data.num_examples=200",
]
STEP_2 = "checkpoints/step_00000002"
LLAMA = "model.config.num_hidden_layers=4"  # 4 stages' worth (the embedding and head weigh one)
TIED = "model.config.tie_word_embeddings=true"  # the first and the last stage share the weight
RUNS = {  # name -> overrides
    "qwen3_gpipe": [
        "model=qwen3",
        "optim=sgd",
        "pp=2",
        "pp_schedule=gpipe",
        "checkpoint.every_steps=2",
    ],
    "qwen3_twin": ["model=qwen3", "optim=sgd"],
    "1f1b_dp": [LLAMA, "pp=2", "dp=2", "checkpoint.every_steps=2"],
    "1f1b_pp4": [LLAMA, "pp=4", "optim=sgd"],
    "twin_sgd": [LLAMA, "optim=sgd", "checkpoint.every_steps=2"],
    "twin": [LLAMA, "checkpoint.every_steps=2"],
    "interleaved": [LLAMA, "pp=2", "pp_schedule=interleaved_1f1b", "pp_stages_per_rank=2"],
    "tp_sp": [LLAMA, "pp=2", "tp=2", "sp=true"],
    "lora": [LLAMA, "pp=2", "peft=lora", "optim=sgd", "optim.lr=0.1"],
    "lora_twin": [LLAMA, "peft=lora", "optim=sgd", "optim.lr=0.1"],
    "tied": [LLAMA, "pp=2", "pp_schedule=gpipe", "optim=sgd", TIED, "checkpoint.every_steps=2"],
    "tied_twin": [LLAMA, "optim=sgd", TIED],
    # the tied weight frozen: no gradient to sum between the first and the last stage
    "tied_lora": [LLAMA, "pp=2", "peft=lora", TIED],
    "tied_lora_twin": [LLAMA, "peft=lora", TIED],
    "pp2_to_pp1": [LLAMA, "checkpoint.resume={out}/1f1b_dp/" + STEP_2],
    "pp1_to_pp2_tp2": [LLAMA, "pp=2", "tp=2", "checkpoint.resume={out}/twin/" + STEP_2],
    # SGD keeps no per-parameter state: only its settings travel, which a stage's optimizer
    # must not tie to that stage's parameters
    "sgd_pp2_to_pp1": [LLAMA, "optim=sgd", TIED, "checkpoint.resume={out}/tied/" + STEP_2],
    "qwen3_sgd_pp2_to_pp1": [
        "model=qwen3",
        "optim=sgd",
        "checkpoint.resume={out}/qwen3_gpipe/" + STEP_2,
    ],
    "sgd_pp1_to_pp2_tp2": [
        LLAMA,
        "optim=sgd",
        "pp=2",
        "tp=2",
        "checkpoint.resume={out}/twin_sgd/" + STEP_2,
    ],
}


LAYOUTS = [  # (pipelined run, its one-process twin)
    pytest.param("qwen3_gpipe", "qwen3_twin", marks=pytest.mark.sweep),
    ("1f1b_dp", "twin"),
    pytest.param("1f1b_pp4", "twin_sgd", marks=pytest.mark.sweep),
    ("interleaved", "twin"),
    ("tp_sp", "twin"),
    ("lora", "lora_twin"),
    ("tied", "tied_twin"),
    ("tied_lora", "tied_lora_twin"),
]


def finetune(output_dir: Path, *overrides: str) -> None:
    command = [
        sys.executable,
        "recipes/finetune.py",
        *COMMON,
        *overrides,
        f"output_dir={output_dir}",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"


def resumed_from(name: str) -> list[str]:
    """The run whose checkpoint run ``name`` resumes, if any."""
    prefix = "checkpoint.resume={out}/"
    return [o.removeprefix(prefix).split("/")[0] for o in RUNS[name] if o.startswith(prefix)]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Path:
    """The selected tests' runs (and the runs their resumes start from), in ``RUNS``' order."""
    out = tmp_path_factory.mktemp("pipeline")
    named = {*selected_params(request, "layout"), *selected_params(request, "twin")}
    named |= set(selected_params(request, "resumed"))
    needed = named | {source for name in named for source in resumed_from(name)}
    for name, overrides in RUNS.items():
        if name in needed:
            finetune(out / name, *(override.format(out=out) for override in overrides))
    return out


@pytest.fixture(scope="module")
def curves(runs) -> dict[str, list[tuple[int, float, float]]]:
    found = {}
    for name in RUNS:
        if not (runs / name).exists():
            continue
        lines = (runs / name / "metrics.jsonl").read_text().splitlines()
        found[name] = [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]
    return found


def assert_same(ours, theirs, steps=(1, 2, 3, 4)) -> None:
    assert [step for step, _, _ in ours] == list(steps)
    for (_, loss, norm), (_, want_loss, want_norm) in zip(ours, theirs, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)


@pytest.mark.parametrize(("layout", "twin"), LAYOUTS)
def test_a_pipelined_run_trains_like_one_process(curves, layout, twin):
    assert_same(curves[layout], curves[twin])


@pytest.mark.parametrize(("layout", "twin"), LAYOUTS)
def test_validation_through_the_stages_equals_one_process(runs, layout, twin):
    """Every validation row once, forward only through the schedule in rounds of its micro-batches
    (the last round filled with unlabelled rows), the same mean as one process's."""

    def val_losses(name: str) -> list[float]:
        records = map(json.loads, (runs / name / "metrics.jsonl").read_text().splitlines())
        return [record["val_loss"] for record in records if "val_loss" in record]

    assert len(val_losses(twin)) == 2
    assert val_losses(layout) == pytest.approx(val_losses(twin), rel=1e-5)


@pytest.mark.parametrize(
    ("resumed", "twin"),
    [
        ("pp2_to_pp1", "twin"),
        pytest.param("pp1_to_pp2_tp2", "twin", marks=pytest.mark.sweep),
        ("sgd_pp2_to_pp1", "tied_twin"),
        pytest.param("qwen3_sgd_pp2_to_pp1", "qwen3_twin", marks=pytest.mark.sweep),
        pytest.param("sgd_pp1_to_pp2_tp2", "twin_sgd", marks=pytest.mark.sweep),
    ],
)
def test_a_checkpoint_resumes_at_another_pp(curves, resumed, twin):
    assert_same(curves[resumed], curves[twin][2:], steps=(3, 4))


@pytest.mark.parametrize(("layout", "twin"), [("lora", "lora_twin")])
def test_the_adapter_of_a_pipelined_lora_run_is_its_twins(runs, layout, twin):
    """peft=lora at pp=2: each stage's adapters, written by a rank of the stage that holds them,
    make the PEFT adapter one process writes."""
    ours = load_file(runs / layout / "adapter" / "adapter_model.safetensors")
    theirs = load_file(runs / twin / "adapter" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and any("lora_B" in name for name in theirs)
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-5 * float(tensor.abs().max()))


@pytest.mark.parametrize(  # SGD both; tied: the embedding written once
    ("layout", "twin"),
    [pytest.param("qwen3_gpipe", "qwen3_twin", marks=pytest.mark.sweep), ("tied", "tied_twin")],
)
def test_the_export_of_a_pipelined_run_is_its_twins(runs, layout, twin):
    def exported(name: str) -> dict[str, torch.Tensor]:
        files = sorted((runs / name / "hf").glob("*.safetensors"))
        return {key: value for file in files for key, value in load_file(file).items()}

    ours, theirs = exported(layout), exported(twin)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        scale = float(tensor.abs().max())
        assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-5 * scale)
