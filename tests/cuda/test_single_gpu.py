"""The single-GPU lane (``pytest -m cuda``; deselected by default): the recipe at tp=1 on CUDA in
fp32 (TF32 off, then on) and bf16-mixed against the same run on the CPU, LoRA on lm_head under the
chunked loss against the unchunked run, a pretrained folder loaded onto the GPU, and an async save
staged through pinned host buffers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from components.checkpoint.dcp import load_checkpoint
from components.checkpoint.state import TrainState
from components.checkpoint.writer import CheckpointWriter
from components.models import build_causal_lm, load_config, meta_causal_lm
from components.models.load import materialize_pretrained
from components.planning.flops import peak_tflops
from components.runtime.launch import free_port
from components.runtime.world import join_world
from recipes.tiny_models import tiny_config

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]
STEPS = 5
COMMON = [
    f"train.max_steps={STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.val_every=0",
    "checkpoint.export=false",
    "data.num_examples=400",
    "nproc=1",
]


@pytest.fixture(autouse=True)
def a_gpu():
    assert torch.cuda.is_available(), "the cuda lane (pytest -m cuda) needs a GPU"


def recipe(
    output_dir: Path, *overrides: str, cpu: bool = False, script: str = "finetune.py"
) -> list[dict]:
    """The recipe's records (``recipes/<script>``), run as a user runs it (on the CPU: no GPU
    visible)."""
    command = [sys.executable, f"recipes/{script}", *COMMON, f"output_dir={output_dir}"]
    environment = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    done = subprocess.run(
        [*command, *overrides],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def relative_gaps(gpu: list[dict], cpu: list[dict]) -> list[float]:
    return [abs(g["loss"] - c["loss"]) / abs(c["loss"]) for g, c in zip(gpu, cpu, strict=True)]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("cpu")
    return {
        "fp32": recipe(root / "fp32", cpu=True),
        "bf16-mixed": recipe(root / "bf16", "train.precision=bf16-mixed", cpu=True),
    }


def test_fp32_without_tf32_matches_the_cpu_run(tmp_path, cpu_runs):
    records = recipe(tmp_path / "run", "train.tf32=false")
    assert len(records) == STEPS and max(relative_gaps(records, cpu_runs["fp32"])) < 1e-3
    assert records[0]["peak_memory_gib"] > 0
    peak = peak_tflops("cuda", "fp32")
    if peak is not None:  # a GPU the table knows: MFU against its plain fp32 peak
        assert records[-1]["mfu"] == pytest.approx(records[-1]["tflops"] / peak, rel=1e-6)


def test_fp32_with_tf32_trains_like_the_cpu_run(tmp_path, cpu_runs):
    records = recipe(tmp_path / "run")  # train.tf32=true, the default
    assert max(relative_gaps(records, cpu_runs["fp32"])) < 1e-2
    peak = peak_tflops("cuda", "tf32")
    if peak is not None:
        assert records[-1]["mfu"] == pytest.approx(records[-1]["tflops"] / peak, rel=1e-6)


def test_bf16_mixed_trains_like_the_cpu_run(tmp_path, cpu_runs):
    records = recipe(tmp_path / "run", "train.precision=bf16-mixed")
    assert max(relative_gaps(records, cpu_runs["bf16-mixed"])) < 3e-2
    assert records[-1]["loss"] < records[0]["loss"]


def test_an_adapted_lm_head_under_the_chunked_loss_equals_its_own_forward(tmp_path):
    """LoRA on lm_head: the chunked loss (the default) adds the adapter's update chunk by chunk on
    the GPU as on the CPU, equal to the head's own forward (``train.loss_chunk_tokens=0``)."""
    lora = ["peft=lora", "peft.target_modules=[lm_head,*.q_proj]", "train.tf32=false"]
    chunked = recipe(tmp_path / "chunked", *lora)
    unchunked = recipe(tmp_path / "unchunked", *lora, "train.loss_chunk_tokens=0")
    for ours, theirs in zip(chunked, unchunked, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pretrained_folder_loads_onto_the_gpu_exactly(tmp_path, dtype):
    source = build_causal_lm(tiny_config("llama"), seed=3).to(dtype)
    source.save_pretrained(tmp_path)
    model = meta_causal_lm(load_config(tmp_path)).to(dtype)
    materialize_pretrained(model, tmp_path, device="cuda")
    loaded = model.state_dict()
    for name, tensor in source.state_dict().items():
        assert loaded[name].device.type == "cuda" and torch.equal(loaded[name].cpu(), tensor), name


@pytest.fixture
def world(monkeypatch):
    """A world of one rank on GPU 0, joined as the recipe's ranks join theirs."""
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for name, value in {**environment, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    device = join_world("cuda", dist.default_pg_timeout, cpu_threads=1, seed=0)
    yield device
    dist.destroy_process_group()


def test_an_async_save_stages_through_pinned_host_buffers(tmp_path, world):
    model = build_causal_lm(tiny_config("llama"), seed=0).to(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, model.config.vocab_size, (2, 16), device=world)
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    keys = dict(keep=2, run_id="run", run_info=None)
    writer = CheckpointWriter(tmp_path / "checkpoints", **keys, asynchronous=True)
    writer.save(TrainState(model=model, optimizer=optimizer, schedule=None, step=2))
    buffers = list(writer._stager._state_dict_stager._cached_storage_mapping.values())
    assert buffers and all(buffer.is_pinned() for buffer in buffers)
    assert writer.take_stall()["checkpoint_stall_s"] > 0
    writer.close()
    restored = build_causal_lm(tiny_config("llama"), seed=1).to(world)
    load_checkpoint(writer.last_path, restored, torch.optim.AdamW(restored.parameters()), None)
    for saved, loaded in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(saved, loaded)
