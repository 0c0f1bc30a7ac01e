"""Context parallelism: peak memory per rank at cp 1/2/4, and the bytes its collectives move.

    .venv/bin/python bench/context_parallel.py memory [--cp 1 2 4] [--seq 8192] [--ac none full]
    .venv/bin/python bench/context_parallel.py bytes [--cp 2 4] [--seq 2048]     # one step

``memory``: the recipe itself (``python recipes/finetune.py``), a Llama of hidden 512, 6 layers
(8 heads of 64, 4 KV heads, intermediate 1536), fp32, tp=1, one packed ``--seq``-token row per
step, 2 AdamW steps; the figure is step 2's ``peak_memory_gib`` (the busiest rank's peak RSS),
printed beside :func:`planned_gib`, the memory model's total for the same overrides (the dry
run's). ``bytes``: the same model on ``cp`` gloo ranks, one forward and backward of one row;
every ``all_gather_single`` / ``reduce_scatter_single`` of the context-parallel attention is
counted (bytes this rank receives) beside :func:`expected_bytes`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "head_dim": 64}
SHAPE |= {"num_key_value_heads": 4, "intermediate_size": 1536, "max_position_embeddings": 8192}


def expected_bytes(seq: int, cp: int) -> int:
    """Bytes one rank receives per step: each layer gathers K and V ((cp-1)/cp of [seq, kv dim]
    each, fp32) forward and reduce-scatters their gradients (the same volume) in backward."""
    kv_dim = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    return SHAPE["num_hidden_layers"] * 2 * 2 * (cp - 1) * (seq // cp) * kv_dim * 4


def dry_run_plan(overrides: list[str]) -> dict:
    """plan.json of ``dry_run=true`` with ``overrides`` (the recipe's command line)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "recipes/finetune.py", *overrides, "dry_run=true"]
        command.append(f"output_dir={folder}")
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment)
        if result.returncode:
            raise RuntimeError(result.stderr[-2000:])
        return json.loads((Path(folder) / "plan.json").read_text())


def planned_gib(overrides: list[str]) -> float:
    """The memory model's peak per rank for a recipe run of ``overrides``: plan.json's ``total``
    of ``dry_run=true`` (``components.planning``: the busiest rank, its runtime included)."""
    return dry_run_plan(overrides)["per_rank_gib"]["total"]


def recipe_overrides(cp: int, seq: int, ac: str) -> list[str]:
    shape = SHAPE | {"max_position_embeddings": max(seq, SHAPE["max_position_embeddings"])}
    overrides = [f"model.config.{key}={value}" for key, value in shape.items()]
    overrides += [f"cp={cp}", f"train.seq_len={seq}", "train.packing=true", "train.max_steps=2"]
    overrides += ["train.global_batch_size=1", "train.micro_batch_size=1", "train.val_every=0"]
    overrides += ["train.warmup_steps=0", "checkpoint.export=false"]
    return overrides + [
        f"data.num_examples={max(4000, seq // 2)}",
        f"train.activation_checkpointing={ac}",
    ]


def recipe_peak(cp: int, seq: int, ac: str, root: Path) -> dict:
    """The recipe's two steps at this cp: each step's metrics line."""
    output = root / f"cp{cp}_seq{seq}_{ac}"
    command = [sys.executable, "recipes/finetune.py", *recipe_overrides(cp, seq, ac)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command.append(f"output_dir={output}")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def memory(cps: list[int], seq: int, acs: list[str], keep: Path | None) -> None:
    """One table row per (ac, cp); each row is also appended to ``keep``/rows.jsonl as it ends."""
    print(f"| ac | cp | seq | step 1 GiB | step 2 GiB/rank | planned | ratio to cp={cps[0]} |")
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        root = keep or Path(folder)
        root.mkdir(parents=True, exist_ok=True)
        for ac in acs:
            first = None
            for cp in cps:
                steps = recipe_peak(cp, seq, ac, root)
                peak = steps[-1]["peak_memory_gib"]
                first = first or peak
                planned = planned_gib(recipe_overrides(cp, seq, ac))
                row = {"ac": ac, "cp": cp, "seq": seq, "steps": steps, "planned_gib": planned}
                with (root / "rows.jsonl").open("a") as rows:
                    rows.write(json.dumps(row) + "\n")
                print(
                    f"| {ac} | {cp} | {seq} | {steps[0]['peak_memory_gib']:.3f} | {peak:.3f} | "
                    f"{planned:.3f} | {peak / first:.3f} |",
                    flush=True,
                )


def _counting(counts: dict, name: str):
    original = getattr(dist, name)

    def call(*args, **kwargs):
        if len(args) >= 2:
            output, tensor = args[:2]
        else:  # FSDP's reduce-scatter passes keywords
            output, tensor = kwargs.get("output"), kwargs.get("input")
        received = output if name == "all_gather_single" else tensor
        if received.ndim == 4:  # the attention's [cp·batch, heads, n, dim]; FSDP's buffers are flat
            counts[name] = counts.get(name, 0) + received.numel() * received.element_size()
        return original(*args, **kwargs)

    return call


def _count_rank(seq: int) -> dict:
    """One forward and backward of one ``seq``-token row on this rank's share; bytes received."""
    from components.distributed.context_parallel import ContextParallel
    from components.distributed.layout import resolve_parallel_dims
    from components.models.parallelize import ModelSpec, build_parallel_model
    from components.runtime.world import init_process_group
    from components.training.step import forward_backward
    from recipes.tiny_models import tiny_config

    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(1)
    cp = dist.get_world_size()
    dims = resolve_parallel_dims(cp, cp=cp)
    meshes = dims.build_meshes("cpu")
    mesh = meshes.world
    spec = ModelSpec(
        config=tiny_config("llama", **SHAPE),
        weights=None,
        seed=0,
        sequence_parallel=False,
        experts=(),
        routers=(),
        precision="fp32",
        activation_checkpointing="none",
        compile=False,
    )
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("cpu"))
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    counts: dict = {}
    originals = {
        name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")
    }
    for name in originals:
        setattr(dist, name, _counting(counts, name))
    try:
        forward_backward(model, ids, ids, seq, cp=ContextParallel.of(mesh))
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    # the all-gather's output holds this rank's own shard too: received is (cp-1)/cp of it, and a
    # reduce-scatter moves (cp-1)/cp of its input per rank
    return {name: n * (cp - 1) // cp for name, n in counts.items()}


def collective_bytes(cps: list[int], seq: int) -> None:
    from components.runtime.launch import launch_local

    print("| cp | seq | all-gather K/V (fwd) | reduce-scatter dK/dV (bwd) | measured | analytic |")
    print("|---|---|---|---|---|---|")
    for cp in cps:
        counts = launch_local(_count_rank, cp, seq)[0]
        total = sum(counts.values())
        gathered, scattered = counts["all_gather_single"], counts["reduce_scatter_single"]
        mib = 1024**2
        print(
            f"| {cp} | {seq} | {gathered / mib:.2f} MiB | {scattered / mib:.2f} MiB | "
            f"{total / mib:.2f} MiB | {expected_bytes(seq, cp) / mib:.2f} MiB |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["memory", "bytes"])
    parser.add_argument("--cp", type=int, nargs="+")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--ac", nargs="+", default=["none"], choices=["none", "full"])
    parser.add_argument("--keep", type=Path, help="memory: keep the runs' folders here")
    args = parser.parse_args()
    if args.what == "memory":
        memory(args.cp or [1, 2, 4], args.seq or 8192, args.ac, args.keep)
    else:
        collective_bytes(args.cp or [2, 4], args.seq or 2048)


if __name__ == "__main__":
    main()
