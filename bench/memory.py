"""Memory per rank: parameter + gradient + AdamW-state bytes at tp 1, 2 and 4, from the TP plan's
local shards.

Why: tensor parallelism is there to fit a model that does not fit one device; the plan should divide
the training state by ``tp`` except for the small replicated parameters (norms). This computes the
bytes each rank holds from the local shard shapes after ``apply_tp_plan`` on the meta device
(nothing is allocated, so an 8B model costs nothing), for the tiny Llama and a Llama-3-8B-shaped
config.

Counted per rank, fp32 (``bf16`` halves every term): parameters (local shards; a replicated
parameter in full), gradients (same shapes), AdamW ``exp_avg`` and ``exp_avg_sq`` (same shapes; the
step counters are ignored). Activations, communication buffers and the allocator's slack are not
counted.

The second part (``--measured``, minutes per configuration on 2 cores) runs one real AdamW step of a
~0.47B Llama shape (``real_size.llama_half_b``: hidden 1024, 24 layers, MLP 4096, vocab 32000) at
seq_len 1024 on fresh ranks for tp 1/2/4 x fp32/bf16-mixed/bf16 x activation checkpointing
none/full, and puts the measured peak RSS per rank beside the expectation: state (analytic, from the
local shard bytes) + activations saved for backward (counted by a saved-tensor hook) + under full
checkpointing the block inputs (L x s x h). Each result is also appended as a JSON line to ``--out``
so a long run can be read while it goes.
"""

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig

from components.distributed.tp_plan import apply_tp_plan
from components.models import local_parameter_bytes, meta_causal_lm
from components.models.families import plan_for
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group
from recipes.tiny_models import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size  # noqa: E402

GIB = 1024**3
MIB = 1024**2
TP_SIZES = (1, 2, 4)


def llama3_8b_config() -> LlamaConfig:
    """Llama-3-8B's shapes (32 layers, hidden 4096, 32 heads / 8 kv heads, MLP 14336, vocab
    128256)."""
    return LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )


CONFIGS = {
    "tiny Llama (vocab 384)": lambda: tiny_config("llama", vocab_size=384),
    "Llama-3-8B shapes": llama3_8b_config,
}


def _replicated_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if not (isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))
    )


def _local_state(tp: int) -> dict[str, tuple[int, int, int]]:
    """(parameter bytes, replicated parameter bytes, total parameters) per config on this rank."""
    out = {}
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)) if tp > 1 else None
    for name, make_config in CONFIGS.items():
        config = make_config()
        model = meta_causal_lm(config)
        total = sum(p.numel() for p in model.parameters())
        if mesh is not None:
            apply_tp_plan(model, mesh, plan_for(config), config)
        out[name] = (local_parameter_bytes(model), _replicated_bytes(model), total)
    return out


def _rank(tp: int) -> dict[str, tuple[int, int, int]]:
    init_process_group("gloo", timedelta(minutes=10))
    try:
        return _local_state(tp)
    finally:
        dist.destroy_process_group()


def run() -> list[str]:
    """Compute the table for every tp; print it; return the (empty) goal lines."""
    lines = [
        "### Training state per rank (fp32 parameters + gradients + AdamW moments, local TP "
        "shards)",
        "",
        "| model | params | tp | params MiB | + grads MiB | + AdamW MiB | total per rank | × "
        "(tp=1 total / tp) "
        "| replicated params KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results = {1: _local_state(1)}
    for tp in TP_SIZES[1:]:
        per_rank = launch_local(_rank, tp, tp)
        sizes = {ranks[name][0] for ranks in per_rank.values() for name in CONFIGS}
        results[tp] = per_rank[0]
        assert len(sizes) == len(CONFIGS), f"ranks disagree on their local bytes at tp={tp}"
    for name in CONFIGS:
        base_total = 4 * results[1][name][0]
        for tp in TP_SIZES:
            params, replicated, count = results[tp][name]
            total = 4 * params
            unit, scale = ("GiB", GIB) if base_total > GIB else ("MiB", MIB)
            lines.append(
                f"| {name} | {count / 1e6:.2f} M | {tp} | {params / MIB:.2f} | {params / MIB:.2f} "
                f"| {2 * params / MIB:.2f} | {total / scale:.2f} {unit} | "
                f"{total / (base_total / tp):.3f} "
                f"| {'-' if tp == 1 else f'{replicated / 1024:.2f}'} |"
            )
    print("\n".join(lines), flush=True)
    return []


# (tp, precision, checkpointing) in the order they are measured: the goal pairs first.
MEASURED = [
    (1, "fp32", "none"),
    (1, "fp32", "full"),
    (4, "fp32", "none"),
    (1, "bf16-mixed", "none"),
    (1, "bf16", "none"),
    (4, "fp32", "full"),
    (1, "bf16-mixed", "full"),
    (1, "bf16", "full"),
    (2, "fp32", "none"),
    (2, "fp32", "full"),
    (2, "bf16-mixed", "none"),
    (2, "bf16-mixed", "full"),
    (2, "bf16", "none"),
    (2, "bf16", "full"),
    (4, "bf16-mixed", "none"),
    (4, "bf16-mixed", "full"),
    (4, "bf16", "none"),
    (4, "bf16", "full"),
]
SEQ_LEN = 1024


def expected_gib(result: dict, tp: int, precision: str, checkpointing: str) -> tuple[float, float]:
    """(state, peak) expected on one rank, GiB, above the process's memory before the model was
    built.

    State: parameters + gradients + two AdamW moments, each the local parameter bytes. Peak:
    parameters + moments + the larger of the activations (saved for backward, counted, plus the
    block inputs a full checkpoint keeps: layers x seq_len x hidden in the residual stream's dtype)
    and the gradients, since backward frees activations as it fills gradients. Activations under
    bf16-mixed include autocast's bf16 copy of each weight (saved for backward, so counted).
    """
    params = result["param_bytes"]
    config = real_size.llama_half_b()
    residual_bytes = 2 if precision == "bf16" else 4
    block_inputs = config.num_hidden_layers * SEQ_LEN * config.hidden_size * residual_bytes
    activations = result["saved_gib"] * GIB + (block_inputs if checkpointing == "full" else 0)
    return 4 * params / GIB, (3 * params + max(activations, params)) / GIB


def _row(tp: int, precision: str, checkpointing: str, ranks: dict) -> str:
    result = max(ranks.values(), key=lambda r: r["peak_gib"][-1])  # the rank with the highest peak
    state, total = expected_gib(result, tp, precision, checkpointing)
    peak = result["peak_gib"][-1] - result["before_build_gib"]
    step_peak = (
        result["peak_gib"][-1] - result["before_step_gib"]
    )  # what the step adds: activations or grads
    return (
        f"| {tp} | {precision} | {checkpointing} | {state:.2f} | {result['saved_gib']:.2f} | "
        f"{total:.2f} "
        f"| {peak:.2f} | {step_peak:.2f} | {result['peak_gib'][-1]:.2f} | "
        f"{result['step_s'][-1]:.0f} |"
    )


def run_measured(configs: list[tuple[int, str, str]], out: Path | None) -> list[str]:
    """Measure each (tp, precision, checkpointing); print the table row by row; return the goal
    lines."""
    print(
        "### Peak memory per rank, one AdamW step of a 0.44B Llama shape (seq_len 1024, batch 1), "
        "GiB\n\n"
        "| tp | precision | checkpointing | params+grads+AdamW | activations saved (counted) | "
        "peak Δ expected "
        "| peak Δ measured | step adds (measured) | peak RSS | step s "
        "|\n|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = {}
    for tp, precision, checkpointing in configs:
        ranks = real_size.measure(tp, precision, checkpointing, False, SEQ_LEN, 1, exact_rss=True)
        rows[(tp, precision, checkpointing)] = ranks[0]
        print(_row(tp, precision, checkpointing, ranks), flush=True)
        if out is not None:
            with out.open("a") as file:
                file.write(
                    json.dumps(
                        {
                            "tp": tp,
                            "precision": precision,
                            "checkpointing": checkpointing,
                            **ranks[0],
                        }
                    )
                )
                file.write("\n")
    return _measured_goals(rows)


def _measured_goals(rows: dict) -> list[str]:
    goals = []
    none, full = rows.get((1, "fp32", "none")), rows.get((1, "fp32", "full"))
    if none and full:
        grads = none["param_bytes"] / GIB
        measured = [(r["peak_gib"][-1] - r["before_step_gib"] - grads) for r in (none, full)]
        ratio = measured[0] / measured[1]
        goals.append(
            f"{'PASS' if ratio >= 3 else 'MISS'} full checkpointing cuts activation memory "
            f"{ratio:.1f}x "
            "(goal >= 3x; saved-for-backward counted: "
            f"{none['saved_gib'] / full['saved_gib']:.1f}x)"
        )
    one, four = rows.get((1, "fp32", "none")), rows.get((4, "fp32", "none"))
    if one and four:
        ratio = four["param_bytes"] / one["param_bytes"]
        goals.append(
            f"{'PASS' if ratio <= 0.3 else 'MISS'} tp=4 holds {ratio:.3f}x the per-rank parameter "
            "+ "
            "gradient + AdamW bytes of tp=1 (goal <= 0.3x)"
        )
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--measured", action="store_true", help="also run the measured real-size table"
    )
    parser.add_argument(
        "--only", default="", help="comma list of tp:precision:checkpointing to measure"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="append each measured result as a JSON line"
    )
    arguments = parser.parse_args()
    goals = run()
    if arguments.measured or arguments.only:
        configs = MEASURED
        if arguments.only:
            configs = [
                (int(t), p, c)
                for t, p, c in (item.split(":") for item in arguments.only.split(","))
            ]
        started = time.perf_counter()
        goals += run_measured(configs, arguments.out)
        print(f"\nmeasured in {time.perf_counter() - started:.0f} s")
    print("\n".join(goals))


if __name__ == "__main__":
    main()
