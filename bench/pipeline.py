"""Pipeline parallelism on this CPU (issue 37): the measured bubble against the formula, and the
peak memory of each pipeline stage against the dry run's plan.

    .venv/bin/python bench/pipeline.py bubble [--pp 2 4] [--micro-batches 4 8] [--steps 3]
        [--schedule 1f1b gpipe interleaved_1f1b]  # interleaved: 2 stages per rank
    .venv/bin/python bench/pipeline.py memory [--ac none full] [--schedule 1f1b gpipe]

Both run ``pp`` gloo ranks (``launch_local``, one intra-op thread each), each building its stage as
the recipe does (``build_parallel_model`` with pp, then ``build_pipeline``: torch's schedule over
the recipe's stage modules), a Llama built from its config, fp32, rows of random token ids (every
row full), and AdamW.

``bubble``: hidden 256, 10 layers (12 units: stages of equal units at pp 2 and 4), vocabulary 4,096,
one row of ``--seq`` tokens (512) per micro-batch. Each stage's ``forward_one_chunk`` and
``backward_one_chunk`` are timed: a rank's busy time; its bubble is ``1 - busy / step time`` (the
schedule's ``step``; send and receive waits, the loss and Python between chunks count as idle), over
the steps after the first (which infers shapes). The formula is ``(pp - 1) / (m + pp - 1)`` for
equal stages: the busiest rank is the one to compare. pp=4
on 2 cores is oversubscribed: 4 ranks share 2 cores, so a chunk runs slower while another rank
computes too and the busy time inflates (the bubble reads low).

``memory``: hidden 768, 8 layers (stage 0: the embedding and 4 layers, stage 1: 4 and the head),
vocabulary 8,192, 4 micro-batches of 2 × 512 tokens; each rank's peak RSS per step (reset at the
step's start, read after the update: ``components.planning.memory``), malloc as the recipe sets it
(``components/runtime/malloc.py``), beside plan.json's ``per_stage_gib`` of ``dry_run=true`` with
the same overrides. Goal: within 20 %. ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment (the
recipe then leaves malloc alone): the RSS is exactly the live bytes, the figure the plan models.
"""

from components.runtime.malloc import exec_with_malloc_settings

if __name__ == "__main__":  # before torch, as the recipe: the RSS reads as live bytes
    exec_with_malloc_settings()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_parallel import dry_run_plan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUBBLE = {"hidden_size": 256, "num_hidden_layers": 10, "intermediate_size": 768}
BUBBLE |= {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
BUBBLE |= {"vocab_size": 4096, "max_position_embeddings": 4096}
MEMORY = {"hidden_size": 768, "num_hidden_layers": 8, "intermediate_size": 2048}
MEMORY |= {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
MEMORY |= {"vocab_size": 8192, "max_position_embeddings": 512}
TOLERANCE = 0.2
PER_RANK = {"interleaved_1f1b": 2}  # stages per pipeline rank


def _timed(stage, name: str, spans: list) -> None:
    """Time each call of ``stage.name`` into ``spans`` (seconds)."""
    original = getattr(stage, name)

    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans.append(time.perf_counter() - started)

    setattr(stage, name, call)


def _rank(shape: dict, pp: int, schedule: str, m: int, rows: int, seq: int, plan: dict) -> dict:
    """One pipeline rank: ``plan['steps']`` steps of ``m`` micro-batches of ``rows`` × ``seq``;
    per step: busy seconds, step seconds, the peak RSS (GiB) and the RSS before it."""
    import torch.distributed as dist

    from components.distributed.layout import resolve_parallel_dims
    from components.distributed.pipeline import build_pipeline
    from components.models.parallelize import ModelSpec, build_parallel_model
    from components.planning.memory import current_memory_gib, peak_memory_gib, reset_peak_memory
    from components.runtime.world import init_process_group
    from recipes.tiny_models import tiny_config

    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(1)
    dims = resolve_parallel_dims(pp, pp=pp)
    meshes = dims.build_meshes("cpu")
    mesh = meshes.world
    plain = dict(weights=None, seed=0, sequence_parallel=False, experts=(), routers=())
    how = dict(precision="fp32", activation_checkpointing=plan["ac"], compile=False)
    config = tiny_config("llama", **shape)
    spec = ModelSpec(config=config, **plain, **how, pp_stages_per_rank=PER_RANK.get(schedule, 1))
    model, _ = build_parallel_model(spec, dims, meshes, torch.device("cpu"))
    data = SimpleNamespace(micro_batches_per_step=m)
    per_rank = PER_RANK.get(schedule, 1)
    pipeline = build_pipeline(model, mesh, nullcontext, data, schedule, per_rank)
    spans: list[float] = []
    for stage in pipeline.stages:
        _timed(stage, "forward_one_chunk", spans)
        _timed(stage, "backward_one_chunk", spans)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (m * rows, seq), generator=generator)
    positions = torch.arange(seq).repeat(m * rows, 1)
    steps = []
    for _ in range(plan["steps"]):
        optimizer.zero_grad(set_to_none=True)
        before = current_memory_gib("cpu")
        reset_peak_memory("cpu")
        spans.clear()
        dist.barrier()
        started = time.perf_counter()
        pipeline.forward_backward(ids, ids, positions, ids.numel())
        elapsed = time.perf_counter() - started
        optimizer.step()
        steps.append(dict(busy=sum(spans), step=elapsed, peak=peak_memory_gib("cpu"), rss=before))
    dist.destroy_process_group()
    return {"steps": steps}


def bubble(pps: list[int], ms: list[int], schedules: list[str], steps: int, seq: int) -> list[dict]:
    from components.planning.pipeline_schedule import bubble as formula
    from components.runtime.launch import launch_local

    print("| schedule | pp | m | formula | busiest rank | mean over ranks | per rank | step s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for schedule in schedules:
        for pp in pps:
            for m in ms:
                setting = {"steps": steps, "ac": "none"}
                ranks = launch_local(_rank, pp, BUBBLE, pp, schedule, m, 1, seq, setting)
                per_rank = []
                for rank in range(pp):
                    later = ranks[rank]["steps"][1:]
                    per_rank.append(statistics.mean(1 - s["busy"] / s["step"] for s in later))
                step_s = statistics.mean(s["step"] for s in ranks[0]["steps"][1:])
                expected = formula(schedule, pp, m, PER_RANK.get(schedule, 1))
                row = dict(schedule=schedule, pp=pp, m=m, formula=expected)
                row |= dict(busiest=min(per_rank), mean=statistics.mean(per_rank))
                rows.append(row | {"per_rank": per_rank, "step_s": step_s})
                each = " ".join(f"{value:.3f}" for value in per_rank)
                print(
                    f"| {schedule} | {pp} | {m} | {row['formula']:.3f} | {row['busiest']:.3f} "
                    f"| {row['mean']:.3f} | {each} | {step_s:.2f} |",
                    flush=True,
                )
    return rows


def memory(acs: list[str], schedules: list[str], steps: int) -> list[dict]:
    from components.runtime.launch import launch_local

    m, rows, seq, pp = 4, 2, 512, 2
    print(
        "| schedule | ac | stage | in flight | planned GiB | measured GiB | planned ÷ measured "
        "| plan's runtime | RSS before the step |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    found = []
    for schedule in schedules:
        for ac in acs:
            overrides = [f"model.config.{key}={value}" for key, value in MEMORY.items()]
            overrides += [f"pp={pp}", f"pp_schedule={schedule}", f"train.seq_len={seq}"]
            overrides += [f"train.micro_batch_size={rows}", f"train.global_batch_size={m * rows}"]
            overrides += [f"train.activation_checkpointing={ac}", "train.val_every=0"]
            plan = dry_run_plan(overrides)
            setting = {"steps": steps, "ac": ac}
            ranks = launch_local(_rank, pp, MEMORY, pp, schedule, m, rows, seq, setting)
            for stage in plan["per_stage_gib"]:
                measured = max(s["peak"] for s in ranks[stage["rank"]]["steps"][1:])
                rss = ranks[stage["rank"]]["steps"][-1]["rss"]
                ratio = stage["total"] / measured
                found.append(dict(schedule=schedule, ac=ac, stage=stage, measured=measured))
                print(
                    f"| {schedule} | {ac} | {stage['rank']} | {stage['in_flight']:g} "
                    f"| {stage['total']:.3f} | {measured:.3f} | {ratio:.3f} "
                    f"| {stage['runtime']:.3f} | {rss:.3f} |",
                    flush=True,
                )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["bubble", "memory"])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedule", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--ac", nargs="+", default=["none", "full"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512, help="bubble: tokens per micro-batch")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    malloc = {key: value for key, value in os.environ.items() if "MALLOC" in key}
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average: {load}; {malloc}"
    )
    if args.what == "bubble":
        rows = bubble(args.pp, args.micro_batches, args.schedule, args.steps + 1, args.seq)
    else:
        rows = memory(args.ac, args.schedule, args.steps + 1)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average: {load}")


if __name__ == "__main__":
    main()
