"""QLoRA (components/models/qlora.py) against the peft library's LoRA on the same model whose
adapted linears' weights were replaced by their NF4 round trip (torchao's ``to_nf4`` then
dequantized), same batches and optimizer; a TP shard's NF4 tiles are the whole tensor's (the numbers
do not depend on tp); the NF4 base takes at most 0.3× its bf16 bytes; the merge export path gives
back a base parameter in its dtype."""

from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict
from torchao.quantization import to_nf4

from components.models import build_causal_lm
from components.models.lora import LoraOptions, adapter_state, apply_lora, merge_adapters
from components.models.qlora import (
    QLoRALinear,
    dequantize_base,
    nf4_bytes,
    nf4_problems,
    quantizable,
    quantize_base,
    quantize_nf4,
)
from recipes.tiny_models import tiny_config
from tests.unit.models.test_lora import adapter_losses

OPTIONS = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=None)


def round_trip(weight: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w)) written from the layout's definition: tiles of 16 × 16, each of
    2 × 2 NF4 blocks of 8 × 8 values, each tile's 4 scales one double-quantization block."""
    rows, cols = weight.shape
    blocks = torch.stack(
        [
            weight[r : r + 8, c : c + 8].flatten()
            for R in range(0, rows, 16)
            for C in range(0, cols, 16)
            for r in (R, R + 8)
            for c in (C, C + 8)
        ]
    )
    values = iter(to_nf4(blocks.reshape(-1, 256), 64, 4).get_original_weight().reshape(-1, 64))
    out = torch.empty_like(weight)
    for R in range(0, rows, 16):
        for C in range(0, cols, 16):
            for r in (R, R + 8):
                for c in (C, C + 8):
                    out[r : r + 8, c : c + 8] = next(values).view(8, 8)
    return out


def _twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Our QLoRA model and peft's LoRA on the round-tripped base, with our adapters' values."""
    config = tiny_config("llama", vocab_size=96)
    ours = build_causal_lm(config, seed=0)
    names = apply_lora(ours, OPTIONS, seed=0)
    quantized = quantize_base(ours)
    assert quantized == sorted(names)  # every projection (the head is not targeted)
    base = build_causal_lm(config, seed=0)
    with torch.no_grad():
        for name in names:
            weight = base.get_submodule(name).weight
            weight.copy_(round_trip(weight))
    lora = dict(r=OPTIONS.rank, lora_alpha=OPTIONS.alpha, lora_dropout=0.0, target_modules=names)
    reference = get_peft_model(base, LoraConfig(**lora))
    loaded = set_peft_model_state_dict(reference, adapter_state(ours, torch.float32))
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    return ours, reference


@pytest.mark.parametrize(
    "optimizer_class, options",
    [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)), (torch.optim.SGD, dict(lr=0.5))],
    ids=["adamw", "sgd"],
)
def test_five_steps_equal_peft_lora_on_the_nf4_round_tripped_base(optimizer_class, options):
    ours, reference = _twins()
    ours_losses = adapter_losses(ours, optimizer_class, options)
    theirs_losses = adapter_losses(reference, optimizer_class, options)
    assert ours_losses == pytest.approx(theirs_losses, rel=1e-5)
    assert ours_losses[-1] < ours_losses[0]
    theirs = get_peft_model_state_dict(reference)
    for name, ours_w in adapter_state(ours, torch.float32).items():
        assert ours_w.abs().sum() > 0, name
        torch.testing.assert_close(ours_w, theirs[name], rtol=1e-5, atol=1e-6)
    assert not [n for n, _ in ours.named_parameters() if n.endswith("_proj.weight")]  # NF4 only


@pytest.mark.parametrize("split", [0, 1], ids=["colwise-rows", "rowwise-columns"])
@pytest.mark.parametrize("parts", [2, 4])
def test_a_tp_shards_tiles_are_the_whole_tensors(split, parts):
    """Each part, quantized from the whole, dequantizes bitwise to that part of the whole's round
    trip; quantizing the part on its own would not (the scales' mean is the whole tensor's)."""
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    whole = quantize_nf4(weight, None, 1, 0, None).dequantize(torch.float32)
    assert torch.equal(whole, round_trip(weight))
    for index in range(parts):
        part = quantize_nf4(weight, split, parts, index, None)
        expected = whole.chunk(parts, dim=split)[index]
        assert torch.equal(part.dequantize(torch.float32), expected)
        alone = round_trip(weight.chunk(parts, dim=split)[index].contiguous())
        assert not torch.equal(alone, expected)  # what a shard quantized alone would give


def test_the_nf4_base_takes_at_most_0_3_of_its_bf16_bytes_on_the_live_tensors():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    apply_lora(model, OPTIONS, seed=0)
    quantize_base(model)
    held, bf16 = nf4_bytes(model)
    assert bf16 == 2 * 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)  # 7 projections, 2 layers
    assert held <= 0.3 * bf16


def test_tiles_that_a_split_would_cut_are_refused():
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    apply_lora(model, OPTIONS, seed=0)
    layer = "model.layers.0"
    styles = {f"{layer}.self_attn.k_proj": "colwise", f"{layer}.mlp.down_proj": "rowwise"}
    styles[f"{layer}.self_attn.o_proj"] = "rowwise"
    assert nf4_problems(model, styles, 2) == []
    found = nf4_problems(model, styles, 8)  # down_proj's 128 features / 8 are whole tiles
    assert found == [
        f"peft=qlora stores {layer}.{name}'s weight in NF4 tiles of 16 × 16, and this rank's "
        f"part of it is {shape}: use a tp that leaves multiples of 16, or leave {layer}.{name} "
        "out of peft.target_modules"
        for name, shape in (("self_attn.k_proj", "[4, 64]"), ("self_attn.o_proj", "[64, 8]"))
    ]


def test_tiles_fsdp_would_shard_unevenly_are_refused():
    """FSDP chunks each NF4 base's tiles over its ranks, as many on each: at tp=2 the smallest
    part, k_proj's and v_proj's [16, 64], is 4 tiles, which 2 and 4 ranks divide and 8 do not."""
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    apply_lora(model, OPTIONS, seed=0)
    styles = {name: "colwise" for name, _ in quantizable(model)}
    assert nf4_problems(model, styles, 2, shards=2) == []
    assert nf4_problems(model, styles, 2, shards=4) == []
    [problem] = nf4_problems(model, styles, 2, shards=8)
    attention = [f"model.layers.{i}.self_attn.{kv}_proj (4)" for i in (0, 1) for kv in "kv"]
    assert f"8 does not divide the tiles of {', '.join(attention)}: use a dp" in problem


def test_adapters_on_the_head_alone_are_refused_as_no_qlora():
    """The head's base is never NF4: QLoRA on it alone would be plain LoRA under another name."""
    model = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    apply_lora(model, replace(OPTIONS, target_modules=("lm_head",)), seed=0)
    [problem] = nf4_problems(model, {}, 1)
    assert problem.startswith("peft=qlora stores no base in NF4 here: the adapted linears")
    both = build_causal_lm(tiny_config("llama", vocab_size=96), seed=0)
    targets = ("lm_head", "model.layers.0.self_attn.q_proj")
    apply_lora(both, replace(OPTIONS, target_modules=targets), seed=0)
    assert nf4_problems(both, {}, 1) == []


def test_the_merge_folds_the_adapters_into_the_dequantized_base():
    ours, _ = _twins()
    adapter_losses(ours, torch.optim.AdamW, dict(lr=1e-2))
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        before = ours(input_ids=ids).logits
        dequantize_base(ours)
        assert not any(isinstance(m, QLoRALinear) for m in ours.modules())
        merge_adapters(ours)
        torch.testing.assert_close(ours(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    weight = ours.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert weight.dtype == torch.float32 and not weight.requires_grad
