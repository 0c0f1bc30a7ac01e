"""Numerical blow-ups and replica drift are caught on every rank, before they corrupt the model.

Faults are injected through the documented switch ``debug.fault`` (components/debug/faults.py).
"""

import json
import subprocess
import sys
from pathlib import Path

from tests import cli
from tests.e2e.test_failures import assert_said_on_lines_of_their_own

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "tp=2",
    "train.max_steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=200",
]


def command(output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "recipes/finetune.py", *SMALL, f"output_dir={output_dir}", *overrides]


def run(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return cli.run(
        command(output_dir, *overrides), cwd=REPO, capture_output=True, text=True, timeout=180
    )


def run_piped(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``run`` with stdout and stderr pipes (``| tee``, a Slurm step); its output as bytes."""
    paths = (Path(f"{output_dir}.out"), Path(f"{output_dir}.err"))
    process = cli.PipedProcess(command(output_dir, *overrides), paths, cwd=REPO)
    returncode = process.wait(timeout=180)
    out, err = (path.read_bytes() for path in paths)
    return subprocess.CompletedProcess(process.args, returncode, out, err)


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_gradient_stops_the_run_before_the_update(tmp_path):
    result = run(tmp_path, "debug.fault=nan_grad@3")
    assert result.returncode != 0
    assert "step 3: grad norm is nan; stopped before the update" in result.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_a_nan_gradient_can_skip_the_step_instead(tmp_path):
    result = run(tmp_path, "debug.fault=nan_grad@3", "train.on_nonfinite=skip")
    assert result.returncode == 0, result.stderr[-2000:]
    records = metrics(tmp_path)
    assert [r.get("skipped", False) for r in records] == [False, False, True, False]
    assert records[2]["grad_norm"] is None
    assert all(
        r["grad_norm"] is not None and r["grad_norm"] < 100 for i, r in enumerate(records) if i != 2
    )
    assert json.loads((tmp_path / "replica_drift.json").read_text())["max"] == 0.0


def test_replica_drift_is_detected_and_named(tmp_path):
    result = run(tmp_path, "debug.fault=perturb_replica@2", "debug.check_replicas_every=1")
    assert result.returncode != 0
    assert (
        "step 2: replicated tensors differ across ranks: model.layers.0.input_layernorm.weight"
        in result.stderr
    )
    assert len(metrics(tmp_path)) == 2


def test_without_faults_every_replica_is_bitwise_identical_at_the_end(tmp_path):
    result = run(tmp_path, "debug.check_replicas_every=1", "sp=true")
    assert result.returncode == 0, result.stderr[-2000:]
    drift = json.loads((tmp_path / "replica_drift.json").read_text())
    assert drift["max"] == 0.0 and len(drift["tensors"]) == 5  # 2 layers × 2 norms + the final norm


def test_a_run_with_most_steps_skipped_fails_without_exporting(tmp_path):
    """Through pipes (``| tee``): its error line starts a line of its own, and the log is plain
    lines: one per step (no progress bar's carriage returns), then the summary."""
    # lr 1e38: after the first update every grad norm is non-finite, so 3 of 4 steps are skipped
    skip = ["train.on_nonfinite=skip", "optim.lr=1e38"]
    result = run_piped(tmp_path / "run", *skip, "checkpoint.export=true")
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 of 4 steps were skipped as non-finite"), stderr[-2000:]
    assert "hf/ was not exported" in last and b"done:" not in result.stdout
    assert_said_on_lines_of_their_own(result.stderr, last)
    assert_said_on_lines_of_their_own(result.stdout)  # the notes on stdout too
    assert not (tmp_path / "run" / "hf").exists() and len(metrics(tmp_path / "run")) == 4
    assert b"\r" not in result.stderr + result.stdout  # no progress bar in a pipe
    out = result.stdout.decode().splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert [int(line.split()[1]) for line in steps] == list(range(1, 5))
    assert all(" lr " in line and " grad_norm " in line and " tok/s " in line for line in steps)
    assert sum("skipped (non-finite grad norm)" in line for line in steps) == 3
    (summary,) = [line for line in out if line.startswith("summary: ")]
    assert summary.startswith("summary: steps 1-4 of 4, ") and "no validation loss" in summary
    # The corrected rerun (the default learning rate) into the same folder replaces the failed
    # run's files, trains every step and exports.
    fixed = ["train.on_nonfinite=skip", "overwrite_output_dir=true"]
    result = run(tmp_path / "run", *fixed, "checkpoint.export=true")
    assert result.returncode == 0, result.stderr[-2000:]
    records = metrics(tmp_path / "run")
    assert len(records) == 4 and not any(record.get("skipped") for record in records)
    assert list((tmp_path / "run" / "hf").glob("*.safetensors")), result.stdout[-2000:]


def test_a_lora_export_keeps_a_piped_log_plain(tmp_path):
    """``peft.merge=true`` on a model built from its config writes ``base/`` with transformers'
    ``save_pretrained``, whose "Writing model shards" bar put carriage returns in a piped log; and
    under FSDP over TP (here FSDP's one-rank shard of an offloaded run) gathering the adapters
    logged torch's two-all-gathers hint on every rank."""
    lora = ["peft=lora", "peft.merge=true", "checkpoint.export=true"]
    result = run_piped(tmp_path / "run", *lora, "tp=2", "train.cpu_offload=true")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (tmp_path / "run" / "base" / "config.json").exists()
    log = result.stderr + result.stdout
    assert b"\r" not in log and b"Writing model shards" not in log
    assert b"sequential all_gather" not in log
