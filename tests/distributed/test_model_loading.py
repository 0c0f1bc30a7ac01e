"""materialize_pretrained on real gloo ranks: each rank holds exactly its slice of every checkpoint
tensor,
and the tensor-parallel model's logits equal the single-process model's.

The parent saves the checkpoints and computes reference logits with ``from_pretrained``; each
``check_*`` runs on every rank of a shared pool (see tests/harness.py): build on meta, shard, load,
compare.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM

from components.models import (
    build_causal_lm,
    load_config,
    local_parameter_bytes,
    materialize_pretrained,
    meta_causal_lm,
)
from components.models.checkpoint import Checkpoint
from recipes.tiny_models import tiny_config
from tests.harness import mesh

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

# Colwise leaves each rank its own heads as a plain local tensor, which HF attention reshapes with
# -1 heads.
TP_PLAN = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),  # vocab rows sharded
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}
ATTENTION_PLAN = {name: style for name, style in TP_PLAN.items() if "self_attn" in name}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.Tensor, int]]:
    """name -> (folder, reference logits of from_pretrained, tp=1 parameter bytes)."""
    configs = {
        "llama": tiny_config("llama"),
        "tied": tiny_config("llama", tie_word_embeddings=True),
        "qwen3_moe": tiny_config("qwen3_moe"),
        "llama_bf16": tiny_config("llama"),
    }
    saved = {}
    for name, config in configs.items():
        folder = tmp_path_factory.mktemp(name)
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        build_causal_lm(config, seed=21, dtype=dtype).save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            saved[name] = (str(folder), reference(TOKENS).logits, local_parameter_bytes(reference))
    return saved


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def expected_on_this_rank(full: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` this rank should hold, by chunking mesh dimension after mesh
    dimension."""
    if not isinstance(tensor, DTensor):
        return full
    expected = full
    for placement, coordinate, size in zip(
        tensor.placements,
        tensor.device_mesh.get_coordinate(),
        tensor.device_mesh.shape,
        strict=True,
    ):
        if isinstance(placement, Shard):
            expected = torch.chunk(expected, size, dim=placement.dim)[coordinate]
    return expected


def mismatched_slices(model: nn.Module, full_tensors: dict[str, torch.Tensor]) -> list[str]:
    return [
        name
        for name, tensor in model.named_parameters()
        if not torch.equal(local_of(tensor), expected_on_this_rank(full_tensors[name], tensor))
    ]


# --- TP over all ranks: exact slices, same logits ------------------------------------------------


def check_tp_loading(rank, world_size, folder, reference_logits):
    model = meta_causal_lm(load_config(folder))
    parallelize_module(model, mesh((world_size,), ("tp",)), TP_PLAN)
    materialize_pretrained(model, folder)

    stored = load_file(Path(folder) / "model.safetensors")
    stored.setdefault(
        "lm_head.weight", stored["model.embed_tokens.weight"]
    )  # a tied checkpoint stores one
    sharded = sorted(
        name
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and p.placements[0].is_shard()
    )
    with torch.no_grad():
        logits = model(TOKENS).logits
    return {
        "mismatched": mismatched_slices(model, stored),
        "sharded": len(sharded),
        "lm_head_is_embedding": model.lm_head.weight is model.model.embed_tokens.weight,
        "rotary": model.model.rotary_emb.inv_freq.tolist(),
        "logit_error": (logits - reference_logits).abs().max().item(),
        "bytes": local_parameter_bytes(model),
    }


def assert_tp_loaded(results, reference_bytes):
    for result in results:
        assert result["mismatched"] == []
        assert result["sharded"] == 2 + 2 * 7  # embedding, lm_head, 7 projections per layer
        assert not result["lm_head_is_embedding"]
        assert result["rotary"] == pytest.approx([1.0, 0.1, 0.01, 0.001])
        assert result["logit_error"] < 1e-5
    print(
        f"max |logits - single-process logits| on {len(results)} ranks: "
        f"{max(r['logit_error'] for r in results):.1e}"
    )
    assert len({result["bytes"] for result in results}) == 1
    return results[0]["bytes"] / reference_bytes


def test_tp2_ranks_hold_their_slices_and_match_single_process_logits(ranks2, checkpoints):
    folder, logits, reference_bytes = checkpoints["llama"]
    assert_tp_loaded(ranks2.run(check_tp_loading, folder, logits), reference_bytes)


def test_tp4_local_parameter_bytes_are_about_a_quarter(ranks4, checkpoints):
    folder, logits, reference_bytes = checkpoints["llama"]
    ratio = assert_tp_loaded(ranks4.run(check_tp_loading, folder, logits), reference_bytes)
    print(f"local parameter bytes at tp=4 / tp=1: {ratio:.4f}")
    assert ratio <= 0.3  # only the norms (0.3% of the bytes) are replicated


def test_tied_embedding_untied_by_the_plan_loads_both_copies(ranks2, checkpoints):
    # The checkpoint has no lm_head.weight: the sharded lm_head reads model.embed_tokens.weight.
    folder, logits, reference_bytes = checkpoints["tied"]
    ratio = assert_tp_loaded(ranks2.run(check_tp_loading, folder, logits), reference_bytes)
    assert ratio > 0.5  # the tie was counted once at tp=1; here each rank holds half of two copies


# --- fused experts and a dp x tp grid ------------------------------------------------------------


def check_sharded_experts(rank, world_size, folder):
    """Experts sharded by expert (down_proj) and within experts (gate_up_proj rows), plus attention
    TP."""
    tp = mesh((world_size,), ("tp",))
    model = meta_causal_lm(load_config(folder))
    parallelize_module(model, tp, ATTENTION_PLAN)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name, placement in (("gate_up_proj", Shard(1)), ("down_proj", Shard(0))):
            meta = torch.empty(getattr(experts, name).shape, device="meta")
            setattr(
                experts,
                name,
                nn.Parameter(distribute_tensor(meta, tp, [placement], src_data_rank=None)),
            )
    materialize_pretrained(model, folder)
    reference = AutoModelForCausalLM.from_pretrained(
        folder
    )  # the fused tensors, as transformers builds them
    return mismatched_slices(model, dict(reference.named_parameters()))


def test_fused_experts_are_read_slice_by_slice_from_per_expert_tensors(ranks4, checkpoints):
    assert ranks4.run(check_sharded_experts, checkpoints["qwen3_moe"][0]) == [[]] * 4


def check_dp_by_tp_grid(rank, world_size, folder):
    """TP on the tp axis, then FSDP-style Shard(0) on the dp axis (norms: on the dp submesh
    only)."""
    grid = mesh((2, 2), ("dp", "tp"))
    model = meta_causal_lm(load_config(folder))
    parallelize_module(model, grid["tp"], TP_PLAN)
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if isinstance(parameter, DTensor):
                device_mesh, placements = grid, [Shard(0), *parameter.placements]
            else:
                device_mesh, placements = grid["dp"], [Shard(0)]
            meta = torch.empty(parameter.shape, device="meta")
            module.register_parameter(
                name,
                nn.Parameter(distribute_tensor(meta, device_mesh, placements, src_data_rank=None)),
            )
    materialize_pretrained(model, folder)
    return mismatched_slices(model, load_file(Path(folder) / "model.safetensors"))


def test_dp_by_tp_grid_with_fsdp_style_shards(ranks4, checkpoints):
    assert ranks4.run(check_dp_by_tp_grid, checkpoints["llama"][0]) == [[]] * 4


def check_partial_is_rejected(rank, world_size, folder):
    model = meta_causal_lm(load_config(folder))
    meta = torch.empty(model.model.norm.weight.shape, device="meta")
    partial = DTensor.from_local(meta, mesh((world_size,), ("tp",)), [Partial()], run_check=False)
    model.model.norm.weight = nn.Parameter(partial)
    with pytest.raises(ValueError) as error:
        materialize_pretrained(model, folder)
    return str(error.value)


def test_a_partial_placement_is_rejected_on_every_rank(ranks2, checkpoints):
    expected = (
        "model.norm.weight: cannot load into placement Partial(sum) (only Shard and Replicate)"
    )
    assert ranks2.run(check_partial_is_rejected, checkpoints["llama"][0]) == [expected] * 2


# --- a bf16 checkpoint into fp32 master weights (bf16-mixed)
# ----------------------------------------


def check_bf16_checkpoint_into_fp32_shards(rank, world_size, folder):
    """Build fp32 on meta, shard, load a bf16 checkpoint: every read is this rank's slice in bf16
    (no full tensor, no fp32 copy of it), converted into the fp32 shard on copy; values are the bf16
    ones exactly."""
    model = meta_causal_lm(load_config(folder), dtype=torch.float32)
    parallelize_module(model, mesh((world_size,), ("tp",)), TP_PLAN)
    local_numels = {local_of(p).numel() for p in model.parameters()}
    reads = []
    original_read = Checkpoint.read

    def recording_read(self, key, offset, size):
        tensor = original_read(self, key, offset, size)
        reads.append((key, tensor.dtype, tensor.numel()))
        return tensor

    Checkpoint.read = recording_read
    try:
        materialize_pretrained(model, folder)
    finally:
        Checkpoint.read = original_read
    stored = load_file(Path(folder) / "model.safetensors")
    expected = {name: tensor.float() for name, tensor in stored.items()}
    sharded_keys = {
        n
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and p.placements[0].is_shard()
    }
    return {
        "param_dtypes": {str(p.dtype) for p in model.parameters()},
        "stored_dtypes": {str(t.dtype) for t in stored.values()},
        "read_dtypes": {str(dtype) for _, dtype, _ in reads},
        "oversized_reads": [k for k, _, numel in reads if numel not in local_numels],
        "sharded_reads_smaller": all(
            numel < stored[k].numel() for k, _, numel in reads if k in sharded_keys
        ),
        "mismatched": mismatched_slices(model, expected),
    }


def test_bf16_checkpoint_loads_into_fp32_shards_slice_by_slice(ranks2, checkpoints):
    for result in ranks2.run(check_bf16_checkpoint_into_fp32_shards, checkpoints["llama_bf16"][0]):
        assert result["stored_dtypes"] == {"torch.bfloat16"} and result["param_dtypes"] == {
            "torch.float32"
        }
        assert result["read_dtypes"] == {"torch.bfloat16"}
        assert result["oversized_reads"] == [] and result["sharded_reads_smaller"]
        assert result["mismatched"] == []
