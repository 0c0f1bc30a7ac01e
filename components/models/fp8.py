"""FP8 training (``train.precision=fp8``): torchao's float8 linears in place of the decoder's
``nn.Linear`` layers, on top of ``bf16-mixed`` (fp32 master weights, gradients, optimizer state).

Converted: every plain ``nn.Linear`` inside a decoder block; never the output head, the embedding,
routers or experts (an MoE model is refused: its experts are grouped weights, torchao 0.18's float8
training takes ``nn.Linear`` only, its float8 grouped GEMM is a CUDA-only prototype).
``train.fp8_recipe``: ``tensorwise`` (one dynamic scale per tensor) or ``rowwise`` (one per row,
powers of two). Under TP with tensorwise the plan's styles become torchao's float8 ones
(``components.distributed.float8_tp``; over gloo with sp, colwise alone); under FSDP with
tensorwise the weights are all-gathered in fp8, their scales computed in one all-reduce after each
optimizer step. ``torch._scaled_mm`` needs matmul dimensions that are multiples of 16: the layers'
features (each rank's share under TP) are checked before any rank starts, and micro-batches are
padded to it.

Docs: docs/precision-and-memory.md
"""

import fnmatch
from dataclasses import dataclass, replace

import torch
from torch import nn
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

from components.models.build import decoder_blocks

MULTIPLE = 16  # torch._scaled_mm: both dimensions of its second operand, the inner one of the first


@dataclass(frozen=True, kw_only=True)
class Fp8Options:
    """How the linears are converted: the recipe, and whether FSDP all-gathers the weights."""

    recipe: str  # tensorwise | rowwise (components.models.options.FP8_RECIPES)
    data_parallel: bool  # FSDP shards the weights over dp: float8 all-gather under tensorwise
    excluded: tuple[str, ...] = ()  # module patterns never converted: MoE routers and experts
    # torchao's emulation: the same float8 casts, the matmul of the dequantised values in fp32; for
    # the CPU, whose torch._scaled_mm on two e4m3 operands takes ~3 s for 512×256×512 (bf16: 3 ms)
    emulate: bool = False

    @property
    def fsdp_float8_all_gather(self) -> bool:
        """torchao all-gathers fp8 weights with one scale per tensor only (tensorwise)."""
        return self.data_parallel and self.recipe == "tensorwise"


def fp8_linears(model: nn.Module, excluded: tuple[str, ...] = ()) -> dict[str, nn.Linear]:
    """The layers fp8 converts, by name: every plain ``nn.Linear`` inside a decoder block, except
    those matching the ``excluded`` patterns (routers, experts) or inside a match."""
    blocks = {id(block) for block in decoder_blocks(model)}
    found: dict[str, nn.Linear] = {}
    for prefix, block in model.named_modules():
        if id(block) not in blocks:
            continue
        for name, module in block.named_modules(prefix=prefix):
            parts = name.split(".")
            ancestry = [".".join(parts[: i + 1]) for i in range(len(parts))]
            skip = any(fnmatch.fnmatchcase(a, p) for a in ancestry for p in excluded)
            if type(module) is nn.Linear and not skip:
                found[name] = module
    return found


def fp8_shape_errors(model: nn.Module, tp: int = 1, styles: dict[str, str] | None = None) -> list:
    """The converted layers whose matmul dimensions are not multiples of 16, as one problem naming
    the first and counting the rest (empty when all fit). ``styles``: the TP plan's style per module
    name: a ``colwise`` layer's rank holds out_features / ``tp``, a ``rowwise`` one in_features /
    ``tp``."""
    bad = []
    for name, linear in fp8_linears(model).items():
        style = (styles or {}).get(name, "")
        shares = {
            "in_features": (linear.in_features, tp if style.startswith("rowwise") else 1),
            "out_features": (linear.out_features, tp if style.startswith("colwise") else 1),
        }
        for key, (size, split) in shares.items():
            if (size // split) % MULTIPLE:
                per_rank = f" ({size // split} per rank at tp={tp})" if split > 1 else ""
                bad.append(f"{name} has {key}={size}{per_rank}")
                break
    if not bad:
        return []
    more = f", and {len(bad) - 1} more layers" if len(bad) > 1 else ""
    return [
        f"train.precision=fp8 needs every matmul dimension a multiple of {MULTIPLE} "
        f"(torch._scaled_mm), but {bad[0]}{more}: choose model sizes that are, or "
        "train.precision=bf16-mixed"
    ]


def fp8_problems(model: nn.Module, is_moe: bool, lora: bool, device_type: str) -> list[str]:
    """Why fp8 cannot train ``model`` here, beyond its shapes (:func:`fp8_shape_errors`)."""
    found = []
    if is_moe:
        found.append(
            "train.precision=fp8 with an MoE model is not supported: torchao 0.18's float8 "
            "training converts nn.Linear layers, and the experts are grouped weights (torchao's "
            "float8 grouped GEMM, torchao.prototype.moe_training, is a prototype on "
            "torch._scaled_grouped_mm, which has no CPU kernel); use train.precision=bf16-mixed"
        )
    if lora:
        found.append(
            "train.precision=fp8 with peft=lora or peft=qlora is not supported (the frozen base "
            "would need float8 linears with adapters): use train.precision=bf16-mixed"
        )
    if device_type == "cuda" and (capability := torch.cuda.get_device_capability()) < (8, 9):
        found.append(
            "train.precision=fp8 needs a GPU with float8 matmuls (compute capability 8.9 or "
            f"later; this one is {capability[0]}.{capability[1]}): use train.precision=bf16-mixed"
        )
    kind = type(model).__name__
    try:
        linears = fp8_linears(model)
    except ValueError:  # no decoder blocks found
        return [
            *found,
            f"train.precision=fp8 with {kind} is not supported: fp8 converts the linears of the "
            "decoder blocks, and its blocks were not found (no model.layers); use "
            "train.precision=bf16-mixed",
        ]
    if not linears:
        found.append(f"train.precision=fp8 finds no linear layer in the blocks of {kind}")
    return found


def convert_to_fp8(model: nn.Module, options: Fp8Options) -> list[str]:
    """Swap :func:`fp8_linears` for torchao's ``Float8Linear`` in place (same parameters, same
    names); return their names. Before the TP plan and FSDP, which see the converted layers."""
    config = Float8LinearConfig.from_recipe_name(options.recipe)
    if options.fsdp_float8_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise's own
    config = replace(config, emulate=options.emulate)
    names = set(fp8_linears(model, options.excluded))
    convert_to_float8_training(
        model, module_filter_fn=lambda _module, name: name in names, config=config
    )
    return sorted(names)


def fp8_scales_after_steps(optimizer, model: nn.Module, options: Fp8Options | None) -> None:
    """With float8 all-gather, compute every weight's scale in one all-reduce after each optimizer
    step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), instead of one per layer inside
    the next forward. A no-op otherwise."""
    if options is None or not options.fsdp_float8_all_gather:
        return
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
