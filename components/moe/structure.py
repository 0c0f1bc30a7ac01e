"""The experts and routers of any Hugging Face MoE model, found from its structure, not a table.

transformers 5 keeps every MoE family's experts in one module of 3-D parameters (one matrix per
expert: ``gate_up_proj``, ``down_proj``; GPT-OSS and Llama 4 likewise), called by its MoE block as
``experts(hidden_states, top_k_index, top_k_weights)``. The router is that block's child whose
``weight`` has one row per expert (``gate`` in Qwen2-MoE, OLMoE, DeepSeek-V3; ``router`` in
Granite-MoE, GPT-OSS). Patterns name them with ``*`` for the layer index, as the family table does.
Llama 4's experts are found too, but take their tokens already routed (:func:`takes_routing`).
"""

import inspect
import re

from torch import nn


def _is_experts(module: nn.Module) -> bool:
    """A module holding one matrix per expert: a 3-D parameter of its own with two or more
    matrices, not a convolution's kernel (the short convolutions of Mamba and linear-attention
    layers) nor a single [1, 1, H] probe (SigLIP's attention-pooling head in Gemma 3's vision), in
    a class transformers names for experts (``Qwen3MoeExperts``, ``JetMoeParallelExperts``):
    per-head matrices (Zamba's Mamba, RecurrentGemma's RG-LRU, XLNet's attention) are not."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    if "expert" not in type(module).__name__.lower():
        return False
    return any(p.dim() == 3 and p.shape[0] > 1 for p in module.parameters(recurse=False))


def experts_count(module: nn.Module) -> int:
    """How many experts an experts module holds (the first dimension of its 3-D parameters)."""
    return next(
        p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1
    )


def takes_routing(module: nn.Module) -> bool:
    """Whether an experts module is called with the routing (``hidden_states, top_k_index,
    top_k_weights``), as transformers' experts interface is, rather than with tokens already routed
    (Llama 4's ``experts(hidden_states)``); an expert-parallel module says which it replaced."""
    if hasattr(module, "takes_routing"):
        return module.takes_routing
    return len(inspect.signature(module.forward).parameters) >= 3


def _router(block: nn.Module, experts_name: str, experts: int) -> str | None:
    """The name of the child of ``block`` (beside ``experts_name``) that scores the experts: its
    ``weight`` has one row per expert; None unless exactly one child does."""
    found = [
        name
        for name, child in block.named_children()
        if name != experts_name
        and isinstance(getattr(child, "weight", None), nn.Parameter)
        and child.weight.dim() == 2
        and child.weight.shape[0] == experts
    ]
    return found[0] if len(found) == 1 else None


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", f"{name}.").rstrip(".")


def find_moe_modules(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expert patterns, router patterns) of ``model``, in module order; empty for a dense model."""
    experts: dict[str, None] = {}
    routers: dict[str, None] = {}
    for name, module in model.named_modules():
        if not name or not _is_experts(module):
            continue
        parent, _, child = name.rpartition(".")
        experts[_pattern(name)] = None
        router = _router(model.get_submodule(parent), child, experts_count(module))
        if router is not None:
            routers[_pattern(f"{parent}.{router}" if parent else router)] = None
    return tuple(experts), tuple(routers)
