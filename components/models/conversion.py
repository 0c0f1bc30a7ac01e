"""The built model's conversion before it is parallelised, shared by the recipe and the dry run:
``peft=lora``'s adapters (components/models/lora.py), ``train.precision=fp8``'s float8 linears
(components/models/fp8.py). The TP plan and FSDP then see the converted layers."""

from torch import nn

from components.models.fp8 import Fp8Options, convert_to_fp8
from components.models.lora import LoraOptions, apply_lora


def convert_model(
    model: nn.Module, lora: LoraOptions | None, fp8: Fp8Options | None, seed: int
) -> nn.Module:
    """``model`` converted in place: adapters with ``lora``, float8 linears with ``fp8``; as built
    when both are None (full fine-tuning in another precision)."""
    if lora is not None:
        apply_lora(model, lora, seed=seed)
    if fp8 is not None:
        convert_to_fp8(model, fp8)
    return model
