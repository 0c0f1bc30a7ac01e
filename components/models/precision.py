"""Training precision from one name (``train.precision``): the dtype parameters are built in, the
autocast context of the forward pass, FSDP2's mixed-precision policy, and bf16 casts ahead of TP
activation gathers.

- ``fp32``: everything in fp32 (parameters, gradients, optimizer state, compute, collectives).
- ``bf16-mixed``: fp32 master weights, gradients and optimizer state; bf16 compute: FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` where FSDP wraps the model, else
  ``torch.autocast(device_type, bfloat16)`` on the fp32 weights. The activations TP moves are bf16
  (:meth:`PrecisionPolicy.cast_tp_inputs`: the sequence-parallel all-gathers too); the loss is fp32.
- ``bf16``: parameters built (or loaded) in bf16, so gradients, compute and AdamW's moments are
  bf16: 8 bytes per parameter instead of 16, for the largest models, at the price of updates
  below bf16's resolution being rounded away. ``bf16-mixed`` is the choice when memory allows.
- ``fp8``: ``bf16-mixed``, with the decoder's linear layers in float8 (``components.models.fp8``).

Docs: docs/precision-and-memory.md
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from components.models.build import decoder_blocks
from components.models.options import PRECISIONS


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """What one ``train.precision`` value means for building, running and sharding the model."""

    name: str
    param_dtype: (
        torch.dtype
    )  # parameters as built or loaded: the master weights, their grads and AdamW state
    compute_dtype: torch.dtype  # matmuls and the activations TP moves

    @property
    def mixed(self) -> bool:
        """True when the compute dtype differs from the parameters' (bf16-mixed, fp8)."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device_type: str, fsdp: bool) -> AbstractContextManager:
        """The context to run the forward pass in (the backward needs none).

        bf16 autocast for ``bf16-mixed`` without FSDP (``fsdp`` False: ``ParallelDims.fsdp_wraps``,
        dp = 1 without offload); otherwise a null context: under FSDP the mixed-precision policy
        casts the parameters, and fp32 or bf16 need no cast.
        """
        if self.mixed and not fsdp:
            return torch.autocast(device_type=device_type, dtype=self.compute_dtype)
        return nullcontext()

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: bf16 parameters for compute under ``bf16-mixed``; gradients reduced in
        fp32 in every mode (for ``bf16`` the fp32 reduce-scatter result is rounded to bf16 once,
        into the shard)."""
        param_dtype = self.compute_dtype if self.mixed else None
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def cast_tp_inputs(self, model: nn.Module, fsdp: bool) -> int:
        """Under autocast, cast the input of each block's attention and MLP, and of ``lm_head``, to
        bf16 *before* the TP plan gathers (sequence parallelism) or all-reduces its gradient (plain
        TP).

        Autocast casts a matmul's input where the matmul runs, after the TP hooks moved it in fp32
        (the RMSNorm's output dtype). Casting first halves those bytes and gives bitwise the same
        loss (the gather is exact; the matmul would cast the same values). Left in fp32 by design:
        the residual stream (the embedding's output collective and its gradient), and the loss,
        computed from fp32 logits. Call after ``apply_tp_plan`` (the hook is prepended, so it runs
        before the plan's); a no-op (returns 0) unless this policy uses autocast. Returns how many
        modules got the cast.
        """
        if not self.mixed or fsdp:
            return 0
        modules = [
            getattr(block, name, None)
            for block in decoder_blocks(model)
            for name in ("self_attn", "mlp")
        ]
        modules.append(
            model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        )
        count = 0
        for module in modules:
            if module is not None:
                module.register_forward_pre_hook(
                    _CastHiddenStates(self.compute_dtype), prepend=True, with_kwargs=True
                )
                count += 1
        return count


class _CastHiddenStates:
    """Forward pre-hook: cast a floating ``hidden_states`` (first positional or keyword) while
    autocast is on."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_autocast_enabled(_device_type(args, kwargs)):
            return None
        if args and torch.is_floating_point(args[0]):
            return (args[0].to(self.dtype), *args[1:]), kwargs
        if (
            isinstance(kwargs.get("hidden_states"), torch.Tensor)
            and kwargs["hidden_states"].is_floating_point()
        ):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].to(self.dtype)}
        return None


def _device_type(args: tuple, kwargs: dict) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def precision_policy(name: str) -> PrecisionPolicy:
    """The policy for a ``train.precision`` value: ``fp32``, ``bf16-mixed``, ``bf16`` or ``fp8``.

    Raises:
        ValueError: If ``name`` is not one of them.
    """
    dtypes = {
        "fp32": (torch.float32, torch.float32),
        "bf16-mixed": (torch.float32, torch.bfloat16),
        "bf16": (torch.bfloat16, torch.bfloat16),
        "fp8": (torch.float32, torch.bfloat16),  # the float8 linears convert their own matmuls
    }
    if name not in dtypes:
        raise ValueError(f"train.precision={name!r} is not one of {', '.join(PRECISIONS)}")
    param_dtype, compute_dtype = dtypes[name]
    return PrecisionPolicy(name=name, param_dtype=param_dtype, compute_dtype=compute_dtype)
