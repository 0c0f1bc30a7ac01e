"""The profiler on CUDA (``pytest -m cuda``; deselected by default): ``profile.steps`` records the
GPU's kernels beside the CPU's operators, and ``profile.memory=true`` writes a memory snapshot of
the profiled steps that PyTorch's memory viz reads."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.training.profiler import host_syncs_per_step

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]
COMMON = ["train.max_steps=3", "train.global_batch_size=8", "train.micro_batch_size=4"]
COMMON += ["train.val_every=0", "checkpoint.export=false", "data.num_examples=200", "nproc=1"]


def test_a_cuda_trace_has_kernels_and_the_snapshot_the_profiled_allocations(tmp_path):
    assert torch.cuda.is_available(), "the cuda lane (pytest -m cuda) needs a GPU"
    command = [sys.executable, "recipes/finetune.py", *COMMON, f"output_dir={tmp_path}"]
    command += ["profile.steps=[2,3]", "profile.memory=true"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    trace = tmp_path / "profile" / "rank0.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)  # CUDA activity
    assert set(host_syncs_per_step(trace)) == {2, 3}
    snapshot = pickle.loads((tmp_path / "profile" / "rank0.memory.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # what memory_viz draws
