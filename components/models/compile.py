"""``torch.compile`` per decoder block (``train.compile``), and the one call that wraps the blocks
in order.

Each block's ``forward`` is replaced by its compiled version in place (no ``OptimizedModule``
wrapper), so parameter names do not change; hooks on the block (FSDP2's) run eagerly outside the
compiled region, the TP plan's hooks on its sublayers inside it. Every block has the same code, so
dynamo compiles once. With activation checkpointing the checkpoint wraps the compiled forward.

Refused, with an error that says what to change: an MoE model at ep > 1 (the expert-parallel
dispatch sizes each expert's rows at run time: Dynamo breaks there and recompiles per size).
Blocks holding DTensors compile without AOT autograd's cache: torch 2.13 replays a cached wrapper
for other tensor subclasses (``no attribute 'elem'``, or a SIGSEGV).

Docs: docs/precision-and-memory.md
"""

import shutil

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from components.models.activation_checkpointing import apply_activation_checkpointing
from components.models.build import decoder_blocks

_DEFAULT_BACKEND = "inductor"


def check_compile(
    compile_blocks: bool,
    device_type: str,
    is_moe: bool,
    ep: int,
    backend: str = _DEFAULT_BACKEND,
) -> None:
    """Raise before anything is built if ``train.compile`` cannot work here (see the module
    docstring).

    Raises:
        ValueError: compile on an MoE model at ep > 1, or with inductor on the CPU without a C
            compiler (``cc``).
    """
    if not compile_blocks:
        return
    if is_moe and ep > 1:
        raise ValueError(
            f"train.compile=true with an MoE model at ep={ep} is not supported: expert "
            "parallelism's dispatch sizes each expert's rows at run time, where Dynamo breaks the "
            "graph and recompiles per size; use ep=1 or train.compile=false"
        )
    if backend == "inductor" and device_type == "cpu" and shutil.which("cc") is None:
        raise ValueError(
            "train.compile=true on the CPU needs a C compiler (cc) for inductor: install one"
        )


def compile_blocks(model: nn.Module, backend: str = _DEFAULT_BACKEND) -> int:
    """Compile each decoder block's forward (after the TP plan and activation checkpointing, before
    FSDP).

    Returns the number of blocks compiled. ``backend`` is torch.compile's (``inductor`` for
    training; tests may use ``aot_eager``, which traces the same graphs without generating code).
    """
    blocks = decoder_blocks(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        torch._functorch.config.enable_autograd_cache = False  # module docstring
    for block in blocks:
        # dynamic=False: every step has the same shapes (padded batches); a recompile per new shape
        # is fine.
        block.forward = torch.compile(block.forward, backend=backend, dynamic=False)
    return len(blocks)


def apply_block_wrappers(
    model: nn.Module, activation_checkpointing: str, compile: bool, backend: str = _DEFAULT_BACKEND
) -> None:
    """Wrap every decoder block: compile its forward, then checkpoint that
    (``none``/``full``/``selective``).

    Call after ``apply_tp_plan`` (and expert parallelism), before ``shard_data_parallel``; FSDP's
    hooks must stay outside both wrappers. The checkpoint goes around the compiled code (module
    docstring).

    Raises:
        ValueError: An unknown checkpointing mode, or a model without decoder blocks.
    """
    if compile:
        compile_blocks(model, backend)
    apply_activation_checkpointing(model, activation_checkpointing)
