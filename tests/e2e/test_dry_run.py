"""``dry_run=true`` through the real command line: a Llama-3-70B layout of 64 ranks planned on this
machine (every check, the parallel model built on the meta device over fake ranks), its plan.json
against the arithmetic, a layout that does not fit given a change that fits when planned again
(and the optimizer-state lever's memory per rank, as planning with it gives), a Llama-3.1-405B
shape at pp=8 × tp=8 × dp=16 (1,024 ranks) planned per pipeline stage, and a cp=2 plan against
the measured peak of the same run.

The child's peak RSS is read with ``os.wait4`` (that child's own rusage), not wall-clock time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
LLAMA_3_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "head_dim": 128,
    "max_position_embeddings": 8192,
}
LAYOUT = ["tp=8", "dp=8", "sp=true", "train.seq_len=8192", "train.micro_batch_size=1"]
LAYOUT += ["train.global_batch_size=8", "train.precision=bf16-mixed"]
# the embedded data's examples are short: packed, its rows are 8,192 tokens, as a real job's (the
# dry run plans for the widest micro-batch the data makes)
FULL_ROWS = "train.packing=true"
LLAMA_3_1_405B = LLAMA_3_70B | {"hidden_size": 16384, "num_hidden_layers": 126}
LLAMA_3_1_405B |= {"intermediate_size": 53248, "num_attention_heads": 128}
PIPELINE = ["pp=8", "tp=8", "dp=16", *LAYOUT[2:], "train.global_batch_size=256"]
PIPELINE += ["train.val_every=0"]  # pp: no validation yet


def dry_run(
    output_dir: Path,
    *overrides: str,
    shape: dict = LLAMA_3_70B,
    layout: list = LAYOUT,
    rss: bool = False,
    recipe: str = "finetune",
) -> tuple[dict, str, int | None]:
    """(plan.json, stdout, the child's peak RSS in bytes if ``rss``, else None) of a dry run of
    ``recipes/<recipe>.py`` that must exit 0. The RSS needs a fresh interpreter of our own; else
    it starts warm (tests/cli.py)."""
    model = [f"model.config.{key}={value}" for key, value in shape.items()]
    command = [sys.executable, f"recipes/{recipe}.py", "dry_run=true", f"output_dir={output_dir}"]
    command += [*layout, *model, *overrides]
    if not rss:
        done = cli.run(command, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((output_dir / "plan.json").read_text()), done.stdout, None
    out, err = (output_dir.parent / f"{output_dir.name}.{kind}" for kind in ("out", "err"))
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, err.read_text()[-3000:]
    plan = json.loads((output_dir / "plan.json").read_text())
    return plan, out.read_text(), usage.ru_maxrss * 1024  # ru_maxrss: KiB on Linux


def test_llama_3_70b_at_tp8_dp8_is_planned_on_this_machine(tmp_path):
    output_dir = tmp_path / "plan"
    full = "train.activation_checkpointing=full"
    plan, stdout, peak_rss = dry_run(output_dir, full, FULL_ROWS, "device_memory_gib=80", rss=True)
    assert plan["batch_positions"] == 8192
    assert peak_rss < 4 * GIB
    per_rank = plan["per_rank_gib"]
    assert set(per_rank) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}
    state = (per_rank["params"] + per_rank["grads"] + per_rank["optimizer"]) * GIB
    assert state == pytest.approx(70.55e9 * 16 / 64, rel=0.05)
    non_embedding = 70.55e9 - 128256 * 8192  # lm_head is a matmul, the embedding a lookup
    standard = 6 * non_embedding + 12 * 80 * 64 * 128 * 8192
    assert plan["flops_per_token"] == pytest.approx(standard, rel=0.05)
    assert plan["fits"] is True and "fits in 80 GiB per device" in stdout
    assert per_rank["total"] >= state / GIB + per_rank["activations"]
    # A dry run claims no folder: no run record, no config, nothing a real run would refuse.
    assert sorted(path.name for path in output_dir.iterdir()) == ["plan.json"]


def test_the_plan_is_for_the_widest_micro_batch_the_data_makes(tmp_path):
    """The embedded examples are a few dozen tokens: the recipe pads a micro-batch to its longest
    row, so seq 512 is planned as that many positions, the same plan as a seq_len of exactly
    that (apart from each process's own runtime)."""
    plan, stdout, _ = dry_run(tmp_path / "long", shape={}, layout=["train.seq_len=512"])
    positions = plan["batch_positions"]
    assert plan["seq_len"] == 512 and 0 < positions < 512 and positions % 8 == 0
    assert f"pads a micro-batch to {positions} positions at most" in stdout
    again, _, _ = dry_run(tmp_path / "short", shape={}, layout=[f"train.seq_len={positions}"])
    assert again["batch_positions"] == positions
    for name, value in plan["per_rank_gib"].items():
        if name not in ("runtime", "total"):
            assert value == pytest.approx(again["per_rank_gib"][name], rel=1e-9), name


def test_a_layout_that_does_not_fit_gets_the_smallest_change_and_that_change_fits(tmp_path):
    tight = ["train.micro_batch_size=2", "train.global_batch_size=16", "device_memory_gib=40"]
    tight.append(FULL_ROWS)
    plan, stdout, _ = dry_run(tmp_path / "tight", *tight)
    assert plan["fits"] is False
    change = plan["suggestion"]["change"]
    assert change == "train.activation_checkpointing=full"  # the first change tried, and it fits
    assert f"the smallest change that fits: {change}" in stdout
    again, _, _ = dry_run(tmp_path / "again", *tight, change)
    assert again["fits"] is True
    # the same model priced again, apart from the planning process's own memory (runtime), which
    # each process measures for itself
    planned = plan["suggestion"]["total_gib"] - plan["per_rank_gib"]["runtime"]
    replanned = again["per_rank_gib"]["total"] - again["per_rank_gib"]["runtime"]
    assert replanned == pytest.approx(planned, rel=1e-9)
    # the optimizer-state levers: less per rank, and what planning with them gives
    eight, lever = plan["optimizer_levers"]
    assert [eight["change"], lever["change"]] == ["optim=adamw8bit", "optim=adamw4bit"]
    assert lever["total_gib"] < eight["total_gib"] < plan["per_rank_gib"]["total"]
    assert lever["total_gib"] < plan["per_rank_gib"]["total"]
    assert f"  optim=adamw4bit: {lever['total_gib']:.2f} GiB per rank" in stdout
    quantized, _, _ = dry_run(tmp_path / "quantized", *tight, "optim=adamw4bit")
    replanned = quantized["per_rank_gib"]["total"] - quantized["per_rank_gib"]["runtime"]
    assert replanned == pytest.approx(
        lever["total_gib"] - plan["per_rank_gib"]["runtime"], rel=1e-9
    )
    assert plan["peft_levers"] == []  # asked only when no change of the layout fits


def test_llama_3_1_405b_at_pp8_tp8_dp16_is_planned_per_pipeline_stage(tmp_path):
    """1,024 fake ranks, 16 micro-batches of one 8,192-token row per step, 1F1B: stage s holds
    min(8 - s, 16) micro-batches' layer inputs (full checkpointing, sp: a 1/8 slice each)."""
    full = "train.activation_checkpointing=full"
    overrides = (full, "device_memory_gib=80")
    plan, stdout, _ = dry_run(tmp_path / "plan", *overrides, shape=LLAMA_3_1_405B, layout=PIPELINE)
    assert plan["world_size"] == 1024 and plan["layout"]["pp"] == 8
    stages = plan["per_stage_gib"]
    assert [stage["layers"] for stage in stages] == [15] + [16] * 6 + [15]  # 128 units over 8
    assert [stage["in_flight"] for stage in stages] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert [(stage["embedding"], stage["head"]) for stage in stages] == (
        [(True, False)] + [(False, False)] * 6 + [(False, True)]
    )
    hidden, kv, inner, vocab = 16384, 8 * 128, 53248, 128256
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden
    parameters = 126 * layer + 2 * vocab * hidden + hidden  # ~405.9e9
    state = sum(stage[row] for stage in stages for row in ("params", "grads", "optimizer"))
    assert state * GIB == pytest.approx(parameters * 16 / (8 * 16), rel=1e-3)  # tp 8 × dp 16
    assert plan["pipeline"]["busiest_rank"] == 0
    assert plan["per_rank_gib"]["total"] == max(stage["total"] for stage in stages)
    layer_inputs = 15 * 8 * 8192 * hidden * 2 / 8  # bf16, sequence-parallel over tp
    assert plan["detail_gib"]["layers"] * GIB == pytest.approx(layer_inputs, rel=1e-9)
    assert plan["pipeline"]["bubble"] == pytest.approx(7 / 23)  # (pp - 1) / (m + pp - 1)
    attention = 12 * 126 * 128 * 128 * 8192
    matmuls = 126 * (layer - 2 * hidden) + vocab * hidden  # lm_head, not the embedding or norms
    assert plan["flops_per_token"] == 6 * matmuls + attention
    assert plan["fits"] is True and "fits in 80 GiB per device" in stdout
    assert "bubble 30.4%" in stdout


LLAMA_3_8B = LLAMA_3_70B | {"hidden_size": 4096, "num_hidden_layers": 32}
LLAMA_3_8B |= {"intermediate_size": 14336, "num_attention_heads": 32}
POST_TRAINING = ["tp=8", "dp=8", "train.micro_batch_size=1", "train.global_batch_size=8"]
POST_TRAINING += ["train.precision=bf16-mixed", "device_memory_gib=80"]


def llama_parameters(shape: dict) -> int:
    """A Llama's parameters: its layers, embedding and untied head, final norm."""
    hidden, inner, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * 128, shape["num_key_value_heads"] * 128
    layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden
    return shape["num_hidden_layers"] * layer + 2 * vocab * hidden + hidden


def test_dpo_at_an_8b_policy_prices_its_reference_beside_it(tmp_path):
    """The reference is the policy's starting weights sharded by the same plan (tp 8 × FSDP over
    dp 8): its bytes are the policy's, with no gradients or optimizer state, and in the total."""
    plan, stdout, _ = dry_run(tmp_path, shape=LLAMA_3_8B, layout=POST_TRAINING, recipe="dpo")
    per_rank = plan["per_rank_gib"]
    assert per_rank["params"] * GIB == pytest.approx(llama_parameters(LLAMA_3_8B) * 4 / 64, 1e-3)
    assert per_rank["frozen"] == per_rank["params"]  # fp32 (bf16-mixed), sharded alike
    state = per_rank["params"] + per_rank["frozen"] + per_rank["optimizer"]
    assert per_rank["total"] > state + per_rank["runtime"]
    assert plan["phases_gib"]["frozen_forward"] > 0
    assert f"  {'frozen':<12}{per_rank['frozen']:>10.3f}\n" in stdout


def test_distillation_prices_a_70b_teacher_beside_an_8b_student(tmp_path):
    """The teacher is built from its own config with its own TP plan, on the student's meshes:
    its weights (8.8 × the student's), its forward and the hidden states the KL reads."""
    teacher = [f"teacher.config.{key}={value}" for key, value in LLAMA_3_70B.items()]
    plan, _, _ = dry_run(
        tmp_path, *teacher, shape=LLAMA_3_8B, layout=POST_TRAINING, recipe="distill"
    )
    per_rank, detail = plan["per_rank_gib"], plan["detail_gib"]
    assert per_rank["frozen"] * GIB == pytest.approx(llama_parameters(LLAMA_3_70B) * 4 / 64, 1e-3)
    assert per_rank["params"] * GIB == pytest.approx(llama_parameters(LLAMA_3_8B) * 4 / 64, 1e-3)
    assert detail["teacher_hidden"] > 0 and detail["teacher_logits"] > 0
    state = per_rank["params"] + per_rank["frozen"] + per_rank["optimizer"]
    assert per_rank["total"] > state + per_rank["runtime"]


# A Llama small enough to run here whose full fine-tuning at tp=2 needs more than LoRA in bf16
TINY = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 2048}
TINY |= {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096}
TINY_RUN = ["tp=2", "train.seq_len=256", "train.packing=true", "train.micro_batch_size=1"]
TINY_RUN += ["train.global_batch_size=1", "train.max_steps=2", "train.val_every=0"]
TINY_RUN += ["checkpoint.export=false", "train.warmup_steps=0"]


TINY_SHAPE = [f"model.config.{key}={value}" for key, value in TINY.items()]


def tiny_plan(output_dir: Path) -> tuple[dict, str]:
    """The plan of full fine-tuning at tp=2 of the :data:`TINY` Llama in 0.6 GiB per device."""
    layout = TINY_RUN + TINY_SHAPE
    plan, stdout, _ = dry_run(output_dir, "device_memory_gib=0.6", shape={}, layout=layout)
    return plan, stdout


def test_a_layout_no_change_fits_is_told_the_peft_levers_with_their_memory(tmp_path):
    """As a 70B model on 2 GPUs of 80 GiB (docs/planning.md), at a tiny shape: full fine-tuning
    does not fit and no change of the layout does; LoRA on the frozen base at the run's precision
    (fp32) is less per rank, and in bf16 less again, and fits, each printed with its memory;
    QLoRA's NF4 base (fp32 adapters) is less than LoRA's fp32 base."""
    plan, stdout = tiny_plan(tmp_path)
    assert plan["fits"] is False and plan["suggestion"] is None
    lora, bf16, qlora = plan["peft_levers"]
    changes = [lever["change"] for lever in (lora, bf16, qlora)]
    assert changes == ["peft=lora", "peft=lora train.precision=bf16", "peft=qlora"]
    assert bf16["total_gib"] < lora["total_gib"] < plan["per_rank_gib"]["total"]
    assert qlora["total_gib"] < lora["total_gib"]
    assert bf16["total_gib"] <= 0.6  # (the runtime, this process's, is in each total)
    line = f"  peft=lora train.precision=bf16: {bf16['total_gib']:.2f} GiB per rank (fits)"
    assert line in stdout
    assert f"  peft=qlora: {qlora['total_gib']:.2f} GiB per rank (" in stdout


@pytest.mark.memory  # opt-in: a bf16 run on the CPU and two more dry runs
@pytest.mark.timeout(600)
def test_the_peft_lever_a_plan_names_fits_as_predicted_when_run(tmp_path):
    """The plan of :func:`tiny_plan` names LoRA in bf16 with its memory per rank; planned again
    it is that figure, and run (glibc's mmap threshold fixed, so the RSS is the live bytes) its
    measured peak is within 20 % of it and within the device memory."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    plan, _ = tiny_plan(tmp_path / "full")
    lever = {one["change"]: one["total_gib"] for one in plan["peft_levers"]}
    planned = lever["peft=lora train.precision=bf16"]
    shape = TINY_SHAPE
    overrides = [*TINY_RUN, *shape, "peft=lora", "train.precision=bf16"]
    again, _, _ = dry_run(tmp_path / "again", shape={}, layout=overrides)
    runtime = plan["per_rank_gib"]["runtime"]
    replanned = again["per_rank_gib"]["total"] - again["per_rank_gib"]["runtime"]
    assert replanned == pytest.approx(planned - runtime, rel=1e-9)
    command = [sys.executable, "recipes/finetune.py", *overrides, f"output_dir={tmp_path / 'run'}"]
    done = cli.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    measured = max(json.loads(line)["peak_memory_gib"] for line in lines)
    total = again["per_rank_gib"]["total"]
    print(f"LoRA bf16 at tp=2: planned {total:.3f} GiB, measured {measured:.3f}")
    assert total == pytest.approx(measured, rel=0.2)
    assert measured <= 0.6


# bench/context_parallel.py's Llama: hidden 512, 6 layers, 8 heads of 64, 4 KV heads
CP_SHAPE = {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "head_dim": 64}
CP_SHAPE |= {"num_key_value_heads": 4, "intermediate_size": 1536, "max_position_embeddings": 2048}
CP_RUN = ["cp=2", "train.seq_len=2048", "train.packing=true", "data.num_examples=400"]
CP_RUN += ["train.global_batch_size=1", "train.micro_batch_size=1", "train.max_steps=3"]
CP_RUN += ["train.val_every=0", "train.warmup_steps=0", "checkpoint.export=false"]


@pytest.mark.memory  # opt-in: tests/distributed/test_memory_model.py measures this shape at cp=2
@pytest.mark.timeout(300)
def test_a_cp2_plan_is_within_20_percent_of_the_measured_peak_of_the_same_run(tmp_path):
    """One packed row of 2,048 tokens split over cp=2 (each rank: 1,024 queries over 2,048 keys,
    the [1,024, 2,048] mask, K and V gathered and repeated to every head). glibc's mmap threshold is
    fixed so the RSS is the live bytes (as in tests/distributed/test_memory_model.py, which
    measures the same shape in make test: this is the command line's plan.json against the same
    run's metrics, in the opt-in memory set)."""
    overrides = [*CP_RUN, *(f"model.config.{key}={value}" for key, value in CP_SHAPE.items())]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    for extra in (["dry_run=true", f"output_dir={tmp_path / 'plan'}"], [f"output_dir={tmp_path}"]):
        command = [sys.executable, "recipes/finetune.py", *overrides, *extra]
        done = cli.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["layout"]["cp"] == 2 and plan["layout"]["dp"] == 1
    assert plan["detail_gib"]["attention_mask"] > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    measured = max(json.loads(line)["peak_memory_gib"] for line in lines)
    print(f"cp=2: planned {plan['per_rank_gib']['total']:.3f} GiB, measured {measured:.3f} GiB")
    assert plan["per_rank_gib"]["total"] == pytest.approx(measured, rel=0.2), (plan, measured)
