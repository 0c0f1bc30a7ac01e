"""The ``moe.*`` keys through the real command line (Qwen3-MoE, fp32, CPU), all in make test.

``moe.shard_experts=true`` at ``tp=1 ep=2 dp=4`` (ep_shard = 2: each expert's weights split over the
two copies of its ep group) trains the same 4 steps as replicated experts at ``tp=1 ep=2 dp=2``
(1e-6: only sum order differs), and its checkpoint resumes there (resharded) to the same losses.
``moe.routing_bias_rate`` spreads the routing out: at a tiny learning rate (the router barely moves,
so the load is the bias's doing) the worst layer's imbalance of steps 2-8 drops well below the
unbiased run's (measured: mean 2.0 against 2.9). The bias is training state: a biased run stopped
mid-run and resumed from its checkpoint trains exactly as the uninterrupted one.
"""

import json
import os
import sys
from pathlib import Path

from tests import cli

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "model=qwen3_moe",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.val_every=0",
    "train.warmup_steps=0",
    "schedule=constant_with_warmup",
    "checkpoint.export=false",
    "data.num_examples=200",
]
STEPS = ["train.max_steps=4", "debug.check_replicas_every=1"]
SHARDED = ["tp=1", "ep=2", "dp=4", "moe.shard_experts=true"]  # ep_shard = 2
REPLICATED = ["tp=1", "ep=2", "dp=2", "moe.shard_experts=false"]  # ep_shard = 1: experts whole


def finetune(*overrides: str, sweep: bool = False) -> None:
    """One run, or with ``sweep`` one ``--multirun`` sweep (its jobs in output_dir/0, /1, ...)."""
    flags = ["--multirun"] if sweep else []
    command = [sys.executable, "recipes/finetune.py", *flags, *COMMON, *overrides]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def close(a: list[float], b: list[float], rel: float = 1e-6) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def test_sharded_experts_train_and_resume_like_replicated_ones(tmp_path):
    sharded = tmp_path / "sharded"
    finetune(*SHARDED, *STEPS, "checkpoint.every_steps=2", f"output_dir={sharded}")
    losses = [record["loss"] for record in records(sharded)]
    assert len(losses) == 4
    assert all("expert_imbalance/layer_0" in record for record in records(sharded))
    # one sweep on 2 ranks: replicated from the start (job 0) and from the sharded step 2 (job 1)
    step_2 = sharded / "checkpoints" / "step_00000002"
    out = tmp_path / "replicated"
    resume = f"checkpoint.resume=null,{step_2}"
    finetune(*REPLICATED, *STEPS, resume, f"output_dir={out}", sweep=True)
    assert close([record["loss"] for record in records(out / "0")], losses)
    assert close([record["loss"] for record in records(out / "1")], losses[2:])


def test_the_routing_bias_spreads_the_load(tmp_path):
    out = tmp_path / "bias"
    rates = "moe.routing_bias_rate=0,0.01"
    finetune(
        rates,
        "optim.lr=1e-6",
        "train.max_steps=8",
        "moe.expert_load=experts",
        f"output_dir={out}",
        sweep=True,
    )
    plain, biased = ([r["expert_imbalance"] for r in records(out / job)] for job in ("0", "1"))
    assert plain[0] == biased[0]  # the bias starts at zero and moves after each step
    assert sum(biased[1:]) < 0.8 * sum(plain[1:]), (plain, biased)
    shares = [v for k, v in records(out / "1")[-1].items() if k.startswith("expert_load/layer_0/")]
    assert len(shares) == 8 and abs(sum(shares) - 1) < 1e-9


def test_a_biased_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    out = tmp_path / "bias"
    # At a tiny learning rate the routing is the bias's doing: a resume that lost it (zeros) routes
    # step 4 differently (measured: imbalance 2.65 against 2.02).
    run = [
        "tp=1",
        "ep=2",
        "dp=2",
        "optim.lr=1e-6",
        "train.max_steps=6",
        "moe.routing_bias_rate=0.01",
    ]
    finetune(*run, "train.stop_after=null,3", f"output_dir={out}", sweep=True)
    assert len(records(out / "1")) == 3  # stopped after step 3, with a checkpoint of it
    finetune(*run, "checkpoint.resume=auto", f"output_dir={out / '1'}")
    whole, resumed = records(out / "0"), records(out / "1")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # exact
    assert [r["expert_imbalance"] for r in resumed] == [r["expert_imbalance"] for r in whole]
