"""``dry_run=true`` through the real command line: a Llama-3-70B layout of 64 ranks planned on this
machine (every check, the parallel model built on the meta device over fake ranks), its plan.json
against the arithmetic, and a layout that does not fit given a change that fits when planned again.

The child's peak RSS is read with ``os.wait4`` (that child's own rusage), not wall-clock time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def dry_run(output_dir: Path, *overrides: str) -> tuple[dict, str, int]:
    """(plan.json, stdout, the child's peak RSS in bytes) of a dry run that must exit 0."""
    model = [f"model.config.{key}={value}" for key, value in LLAMA_3_70B.items()]
    command = [sys.executable, "recipes/finetune.py", "dry_run=true", f"output_dir={output_dir}"]
    command += [*LAYOUT, *model, *overrides]
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
    plan, stdout, peak_rss = dry_run(output_dir, full, "device_memory_gib=80")
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


def test_a_layout_that_does_not_fit_gets_the_smallest_change_and_that_change_fits(tmp_path):
    tight = ["train.micro_batch_size=2", "train.global_batch_size=16", "device_memory_gib=40"]
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
