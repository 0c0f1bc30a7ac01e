"""Activation checkpointing per decoder block (``train.activation_checkpointing``).

- ``none``: every activation is kept for backward.
- ``full``: each decoder block keeps only its inputs; its forward is recomputed in backward
  (``torch.utils.checkpoint``, non-reentrant), at the price of one more forward per block.
- ``selective``: as ``full``, but the outputs of matmuls and attention are saved and only the cheap
  ops are recomputed (torch's selective checkpoint policy).

The block's own ``forward`` is wrapped in place (no wrapper module), so parameter names,
checkpoints, the TP plan's patterns and Hugging Face export are unchanged; the hooks on the block
stay outside the checkpointed region. Apply after the TP plan and before FSDP; with
``torch.compile`` the checkpoint goes *around* the compiled forward.

Docs: docs/precision-and-memory.md
"""

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from components.models.build import decoder_blocks
from components.models.options import ACTIVATION_CHECKPOINTING

_MARK = "_shardtune_activation_checkpointed"

# Ops whose outputs ``selective`` saves: the expensive ones (matmuls, attention) and collectives,
# which would otherwise run again in the recompute.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    # A KV cache (transformers builds one unless use_cache=False) would be appended to again by the
    # recompute: twice the keys, and state that differs between forward and recompute. Training
    # needs none.
    if kwargs.get("past_key_values") is not None:
        kwargs = {**kwargs, "past_key_values": None}
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint every decoder block of ``model`` in ``mode`` (``none``, ``full`` or
    ``selective``).

    Returns the number of blocks wrapped (0 for ``none``).

    Raises:
        ValueError: If ``mode`` is unknown, the model has no decoder blocks, or a block is already
            wrapped.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"train.activation_checkpointing={mode!r} is not one of "
            f"{', '.join(ACTIVATION_CHECKPOINTING)}"
        )
    if mode == "none":
        return 0
    blocks = decoder_blocks(model)
    context_fn = _selective_contexts if mode == "selective" else None
    for index, block in enumerate(blocks):
        if getattr(block, _MARK, False):
            raise ValueError(
                f"decoder block {index} already has its forward wrapped: apply checkpointing once"
            )
        block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn)
        setattr(block, _MARK, True)
    return len(blocks)
