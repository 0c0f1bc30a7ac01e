"""Build a Hugging Face causal LM from a config: seeded on the CPU, or weightless on the meta device."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def build_causal_lm(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """The full model on the CPU in fp32 with random weights drawn from ``seed``.

    The same seed gives bitwise identical weights in any process, so ranks that build independently agree
    without a broadcast. The caller's global RNG state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def meta_causal_lm(config: PretrainedConfig) -> PreTrainedModel:
    """The same architecture on the meta device: shapes only, no memory for weights.

    A TP plan can then shard it before anything is allocated; ``materialize_from_pretrained`` (or
    ``to_empty`` plus an initialisation) gives it storage afterwards.
    """
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage held by this rank: a DTensor counts its local shard, a shared parameter once."""
    total = 0
    for parameter in model.parameters():  # parameters() yields a shared (tied) parameter once
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        total += local.numel() * local.element_size()
    return total
