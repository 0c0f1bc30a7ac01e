"""Memory per rank: parameter + gradient + AdamW-state bytes at tp 1, 2 and 4, from the TP plan's local shards.

Why: tensor parallelism is there to fit a model that does not fit one device; the plan should divide the
training state by ``tp`` except for the small replicated parameters (norms). This computes the bytes each
rank holds from the local shard shapes after ``apply_tp_plan`` on the meta device (nothing is allocated, so
an 8B model costs nothing), for the tiny Llama and a Llama-3-8B-shaped config.

Counted per rank, fp32 throughout (the project trains in fp32): parameters (local shards; a replicated
parameter in full), gradients (same shapes), AdamW ``exp_avg`` and ``exp_avg_sq`` (same shapes; the step
counters are ignored). Activations, communication buffers and the allocator's slack are not counted.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig

from components.distributed.launch import init_process_group, launch_local
from components.distributed.tp_plan import apply_tp_plan, plan_for
from components.models import local_parameter_bytes, meta_causal_lm, tiny_config

GIB = 1024**3
MIB = 1024**2
TP_SIZES = (1, 2, 4)


def llama3_8b_config() -> LlamaConfig:
    """Llama-3-8B's shapes (32 layers, hidden 4096, 32 heads / 8 kv heads, MLP 14336, vocab 128256)."""
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
    init_process_group("gloo")
    try:
        return _local_state(tp)
    finally:
        dist.destroy_process_group()


def run() -> list[str]:
    """Compute the table for every tp; print it; return the (empty) goal lines."""
    lines = [
        "### Training state per rank (fp32 parameters + gradients + AdamW moments, local TP shards)",
        "",
        "| model | params | tp | params MiB | + grads MiB | + AdamW MiB | total per rank | × (tp=1 total / tp) "
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
                f"| {2 * params / MIB:.2f} | {total / scale:.2f} {unit} | {total / (base_total / tp):.3f} "
                f"| {'-' if tp == 1 else f'{replicated / 1024:.2f}'} |"
            )
    print("\n".join(lines), flush=True)
    return []


if __name__ == "__main__":
    run()
