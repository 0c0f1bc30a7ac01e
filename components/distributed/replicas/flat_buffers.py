"""Flat communication buffers: the wire dtype, bounded chunks, packing and unpacking many tensors at
once.

Gradient reductions (TP replica sync, Partial -> Replicate finalisation) move many small tensors
through one collective. These helpers are the shared, public pieces: low-precision tensors travel as
FP32, chunks are cut so one buffer never exceeds a byte bound, and packing/unpacking uses
``torch._foreach_copy_`` (one dispatch for the whole list) into slices of a flat buffer.
"""

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

MAX_FLAT_BUFFER_BYTES = 256 * 1024 * 1024
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is reduced in: FP32 for bf16/fp16, its own dtype
    otherwise."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def wire_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` occupies in a flat buffer of its wire dtype."""
    return tensor.numel() * wire_dtype(tensor.dtype).itemsize


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Rank-local storage of a Tensor or DTensor (a plain tensor is its own storage)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def bounded_chunks(tensors: list[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``tensors``, in order, whose wire bytes add up to at most ``max_bytes``.

    A single tensor larger than ``max_bytes`` is a chunk of its own.
    """
    chunk: list[torch.Tensor] = []
    chunk_bytes = 0
    for tensor in tensors:
        size = wire_bytes(tensor)
        if chunk and chunk_bytes + size > max_bytes:
            yield chunk
            chunk, chunk_bytes = [], 0
        chunk.append(tensor)
        chunk_bytes += size
    if chunk:
        yield chunk


def flat_views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat`` of the given shapes (the slots tensors of those shapes pack
    into)."""
    views, offset = [], 0
    for shape in shapes:
        numel = shape.numel()
        views.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return views


def flat_aliases(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Tensors over the same consecutive slots of ``flat``'s storage as :func:`flat_views`, made
    with ``set_`` instead of as views: each keeps a version counter of its own (a view shares its
    base's), so an in-place accumulation into one of them shows on that one alone."""
    storage, offset, aliases = flat.untyped_storage(), flat.storage_offset(), []
    for shape in shapes:
        aliases.append(flat.new_empty(0).set_(storage, offset, shape))
        offset += shape.numel()
    return aliases


def pack(
    tensors: list[torch.Tensor], dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """A new flat buffer of ``dtype`` on ``device`` holding ``tensors`` back to back (cast as
    needed)."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    if tensors:
        torch._foreach_copy_(flat_views(flat, [t.shape for t in tensors]), tensors)
    return flat


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy each slice of ``flat`` back into its tensor, in place and in the tensor's own dtype."""
    if tensors:
        torch._foreach_copy_(tensors, flat_views(flat, [t.shape for t in tensors]))
