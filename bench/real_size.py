"""One training step of a real-size Llama shape on fresh ranks, measured: shared by memory.py and
throughput.py.

Each measured configuration runs in fresh processes (``launch_local``, one per TP rank), so a peak
RSS is that configuration's and nothing is left from the previous one. A rank builds the model on
the meta device, shards it (TP plan), wraps the blocks (bf16 input casts, activation checkpointing,
compile), gives each rank random weights for its own shard only, then runs ``steps`` AdamW steps of
one micro-batch: forward (under the precision's autocast) and backward as the recipe's
``forward_backward`` does, gradient finalisation, replica sync, ``optimizer.step()``. Nothing but
the step is timed.
"""

import ctypes
import ctypes.util
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import LlamaConfig

from components.distributed.grads import finalize_dtensor_gradients
from components.distributed.tp_plan import apply_tp_plan, cross_entropy_sum
from components.distributed.tp_replicas import (
    broadcast_tp_replicas,
    synchronize_tp_replica_gradients,
)
from components.models.build import local_parameter_bytes, materialize_random, meta_causal_lm
from components.models.compile import apply_block_wrappers
from components.models.families import plan_for
from components.models.precision import precision_policy
from components.planning.memory import current_memory_gib, peak_memory_gib, reset_peak_memory
from components.runtime.launch import launch_local
from components.runtime.world import init_process_group

GIB = 1024**3
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def llama_half_b(num_hidden_layers: int = 24) -> LlamaConfig:
    """A ~0.47B-parameter Llama shape: hidden 1024, 24 layers, MLP 4096, 16 heads (8 kv), vocab
    32000."""
    return LlamaConfig(
        hidden_size=1024,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=4096,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SavedActivations:
    """Bytes autograd saves for backward, counted once per storage (pack hook; the tensors are
    untouched), the parameters themselves excluded (a linear layer saves its weight: that is not
    activation memory).

    Under activation checkpointing the checkpoint keeps what its regions save to itself (the block
    inputs, and during backward one block's recomputed activations), so those are not seen here.
    """

    def __init__(self, model: torch.nn.Module):
        self.parameters = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        try:
            key, size = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
        except (
            RuntimeError
        ):  # a tensor without a plain storage (a view DTensor makes on the fly): its bytes
            key, size = id(local), local.numel() * local.element_size()
        if key not in self.parameters:
            self.storages[key] = size
        return tensor

    @property
    def gib(self) -> float:
        return sum(self.storages.values()) / GIB


def _forward_backward(model: torch.nn.Module, tokens: torch.Tensor, autocast) -> float:
    """The recipe's micro-batch with autocast around the forward only (as the recipe does):
    autocast's cache of bf16 weight copies is freed when the forward ends, unless autograd saved
    them."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with loss_parallel():
        with autocast:
            logits = model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        loss_sum = cross_entropy_sum(logits, tokens)
        (loss_sum / (tokens.numel() - 1)).backward()
    return (loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum).item()


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on zero gradients: allocates ``exp_avg``/``exp_avg_sq`` without a forward
    pass."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _return_freed_memory() -> None:
    """Make glibc mmap every allocation from 64 KiB (and so unmap it when freed): the RSS then
    follows the live tensors instead of keeping freed heap, at the price of page faults (memory runs
    only)."""
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(_M_MMAP_THRESHOLD, 64 * 1024)


def _rank_step(
    tp: int,
    precision: str,
    checkpointing: str,
    compile_blocks: bool,
    seq_len: int,
    steps: int,
    exact_rss: bool,
) -> dict:
    if exact_rss:
        _return_freed_memory()
    init_process_group("gloo", timedelta(minutes=10))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    try:
        before_build = current_memory_gib("cpu")  # the process with torch and transformers loaded
        config, policy = llama_half_b(), precision_policy(precision)
        model = meta_causal_lm(config, policy.param_dtype)
        mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            apply_tp_plan(
                model, mesh["tp"], plan_for(config, compile_blocks), config, compile_blocks
            )
        policy.cast_tp_inputs(model, fsdp=False)
        apply_block_wrappers(model, checkpointing, compile_blocks)
        materialize_random(model, seed=0)
        broadcast_tp_replicas([model], mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        _create_optimizer_state(
            model, optimizer
        )  # so the first measured step is a steady-state one
        tokens = torch.randint(
            0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0)
        )
        times, peaks, saved = [], [], SavedActivations(model)
        before_step = current_memory_gib("cpu")
        for step in range(steps):
            reset_peak_memory("cpu")
            dist.barrier()
            started = time.perf_counter()
            hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
            with (
                hooks
                if step == 0
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ):
                loss = _forward_backward(model, tokens, policy.autocast("cpu", fsdp=False))
            finalize_dtensor_gradients([model])
            synchronize_tp_replica_gradients([model], mesh)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - started)
            peaks.append(peak_memory_gib("cpu"))
        return {
            "before_build_gib": before_build,
            "param_bytes": local_parameter_bytes(model),
            "params": sum(p.numel() for p in model.parameters()),
            "saved_gib": saved.gib,
            "before_step_gib": before_step,
            "peak_gib": peaks,
            "step_s": times,
            "loss": loss / (seq_len - 1),
        }
    finally:
        dist.destroy_process_group()


def measure(
    tp: int,
    precision: str,
    checkpointing: str,
    compile_blocks: bool,
    seq_len: int,
    steps: int,
    exact_rss: bool,
) -> dict:
    """Run one configuration on ``tp`` fresh ranks; every rank's result, by rank. ``exact_rss``:
    freed memory goes back to the OS at once (for memory figures; it slows the step)."""
    return launch_local(
        _rank_step, tp, tp, precision, checkpointing, compile_blocks, seq_len, steps, exact_rss
    )
