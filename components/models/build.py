"""Build a Hugging Face causal LM from a config: seeded on the CPU, or weightless on the meta
device."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

from components.models.derived_plan import decoder_layer_list, deeper_allowed


def build_causal_lm(
    config: PretrainedConfig, seed: int, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """The full model on the CPU with random weights drawn from ``seed``, parameters in ``dtype``.

    The same seed gives bitwise identical weights in any process, so ranks that build independently
    agree without a broadcast. The caller's global RNG state is left as it was. ``dtype`` is the
    precision policy's ``param_dtype`` (fp32 for ``fp32`` and ``bf16-mixed``, bf16 for ``bf16``);
    the weights are drawn in fp32 and rounded, so a bf16 build is the fp32 build rounded to bf16.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _cast_parameters(model, dtype)


def meta_causal_lm(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The same architecture on the meta device, parameters in ``dtype``: shapes only, no memory for
    weights.

    A TP plan can then shard it before anything is allocated; ``materialize_pretrained`` (or
    :func:`materialize_random`) gives it storage afterwards, each parameter in its own dtype,
    whatever the checkpoint's (a bf16 checkpoint loads into fp32 master weights slice by slice).
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _cast_parameters(model, dtype)


def _cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Parameters to ``dtype``, buffers untouched: ``model.to(bfloat16)`` would also round the
    rotary ``inv_freq`` (0.1 -> 0.1001), shifting every position's angle. Tied parameters stay one
    object."""
    if dtype != torch.float32:
        for parameter in model.parameters():
            parameter.data = parameter.data.to(dtype)
    return model


@torch.no_grad()
def materialize_random(model: nn.Module, seed: int, device: str = "cpu", std: float = 0.02) -> None:
    """Give a meta-device (possibly TP-sharded) model storage on ``device`` with random weights, per
    shard.

    For benchmarks and shapes without a checkpoint: each rank draws only its local shard (normal,
    ``std``; vectors such as norm weights are set to 1, biases to 0), so no rank ever holds the full
    model. The values are not those of :func:`build_causal_lm`; use that where ranks must agree with
    a reference. Non-persistent buffers (rotary frequencies) are recomputed with the model's
    ``_init_weights``.
    """
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        if local.dim() >= 2:
            local.copy_(torch.randn(local.shape, generator=generator, device=device) * std)
        else:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
    for module in model.modules():
        if any(
            module._buffers.get(name) is not None for name in module._non_persistent_buffers_set
        ):
            model._init_weights(module)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage held by this rank: a DTensor counts its local shard, a shared
    parameter once."""
    total = 0
    for parameter in model.parameters():  # parameters() yields a shared (tied) parameter once
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        total += local.numel() * local.element_size()
    return total


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Hugging Face causal LM, in order: ``model.model.layers``, else the
    list a derived plan splits (``derived_plan.decoder_layer_list``: OPT's
    ``model.decoder.layers``).

    Raises:
        ValueError: If neither is found.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    config = getattr(model, "config", None)
    found = decoder_layer_list(model, config is not None and deeper_allowed(config))
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers: cannot find its decoder blocks"
        )
    return list(found[1])


def save_pretrained_quietly(model: PreTrainedModel, folder) -> None:
    """``model.save_pretrained(folder)`` without transformers' "Writing model shards" bar, whose
    carriage returns would break a log in a file or a pipe into fragments."""
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
