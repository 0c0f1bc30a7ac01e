"""The attention kernel (``model.attn_implementation``): what a run can use, checked before any
rank starts, and how packed rows reach it.

sdpa and eager take packed rows as a dense block-diagonal mask that transformers builds from the
restarting position ids. The packed-native kernels take the boundaries instead: flex_attention a
BlockMask transformers builds from the same restarts; flash_attention_2/3 the cumulative lengths
of the rows' sequences (:func:`pass_sequence_boundaries`), which transformers infers by itself for
a single row only. Design notes: docs/data.md ("The attention kernel").
"""

import importlib.util

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

FLASH = ("flash_attention_2", "flash_attention_3")
# the module each flash kernel is imported from, and the package that installs it
FLASH_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention's hopper build)"),
}
# the class flag transformers reads for each kernel a model class may lack
SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}
HALF_PRECISIONS = ("bf16-mixed", "bf16", "fp8")  # flash kernels compute in bf16/fp16 only


def attention_choice_problems(
    implementation: str | None, config, device_type: str, precision: str, cp: int
) -> list[str]:
    """Why this run cannot use ``implementation`` (None: transformers' default, always usable) for
    the model of ``config`` on ``device_type`` at ``precision`` with context parallel size
    ``cp``: a kernel not installed or not on this device, a model class without it, a precision
    it does not compute in, context parallelism (which runs its own attention)."""
    if implementation is None or implementation == "eager" and cp == 1:
        return []
    key = f"model.attn_implementation={implementation}"
    if cp > 1 and implementation != "sdpa":
        return [
            f"{key} with cp={cp} is not supported: context parallelism computes attention "
            "itself (SDPA over the keys gathered from every cp rank); use "
            "model.attn_implementation=sdpa"
        ]
    found = _kernel_problems(implementation, device_type)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is not None and not getattr(model_class, SUPPORT_FLAGS[implementation], False):
        found.append(
            f"{key} is not supported by model type '{config.model_type}': transformers' "
            f"{model_class.__name__} has no {implementation} path; use "
            "model.attn_implementation=eager"
        )
    if implementation in FLASH and precision not in HALF_PRECISIONS:
        found.append(
            f"{key} with train.precision={precision} is not supported: flash attention "
            "computes in bf16 or fp16 only; use train.precision=bf16-mixed (or bf16, fp8)"
        )
    return found


def _kernel_problems(implementation: str, device_type: str) -> list[str]:
    """A kernel this machine cannot run: flash not installed or not on CUDA; flex_attention on
    the CPU, where PyTorch has no backward for it (measured with torch 2.13: it refuses inputs
    that require grad)."""
    key = f"model.attn_implementation={implementation}"
    if implementation == "flex_attention" and device_type == "cpu":
        return [
            f"{key} cannot train on the CPU: PyTorch's flex_attention has no backward there; "
            "use model.attn_implementation=sdpa (flex_attention on CUDA)"
        ]
    if implementation not in FLASH:
        return []
    module, package = FLASH_PACKAGES[implementation]
    if importlib.util.find_spec(module) is None:
        return [
            f"{key} needs the {package} package, which is not installed: install it (CUDA only) "
            "or use model.attn_implementation=sdpa"
        ]
    if device_type != "cuda":
        return [f"{key} runs on CUDA only, not {device_type}: use model.attn_implementation=sdpa"]
    return []


def set_attention(config, implementation: str | None) -> None:
    """Make models built from ``config`` use ``implementation`` (None: leave transformers' default,
    SDPA where the model class has it, else eager)."""
    if implementation is not None:
        config._attn_implementation = implementation


def sequence_boundaries(position_ids: torch.Tensor) -> dict:
    """transformers' flash-attention keyword arguments for rows [batch, seq] whose positions
    restart at 0 at each sequence: the cumulative lengths of the sequences over the flattened rows
    (every row starts one), and the longest a sequence can be (the row's length: a bound, read
    from the shape, not the device). One read of the device: how many sequences there are."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.tensor([flat.numel()], device=flat.device)
    cumulative = torch.cat([starts, total]).to(torch.int32)
    width = position_ids.shape[-1]
    return {
        "cu_seq_lens_q": cumulative,
        "cu_seq_lens_k": cumulative,
        "max_length_q": width,
        "max_length_k": width,
    }


def _with_boundaries(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    position_ids = kwargs.get("position_ids")
    if position_ids is None or "cu_seq_lens_q" in kwargs:
        return None
    return args, {**kwargs, **sequence_boundaries(position_ids)}


def pass_sequence_boundaries(model: nn.Module) -> None:
    """With a flash kernel, each forward of ``model`` (called with ``position_ids``) also passes
    its rows' sequence boundaries (:func:`sequence_boundaries`) down to the attention: transformers
    finds them itself only in a single row, and would otherwise let a micro-batch's packed examples
    attend to each other. Other kernels: nothing to do."""
    if getattr(model.config, "_attn_implementation", None) in FLASH:
        model.register_forward_pre_hook(_with_boundaries, with_kwargs=True)
