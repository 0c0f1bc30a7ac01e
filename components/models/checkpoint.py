"""Read any slice of a model tensor from a Hugging Face safetensors folder, touching only that
slice's bytes.

The files are read with ``pread`` from their safetensors headers, not memory-mapped, so a rank's
peak RSS during a load is about its shard, not the checkpoint. A box is read straight into its
tensor where its rows are whole, else through a scratch of at most 16 MiB of whole rows.

Where each model tensor is stored (:class:`StoredLayout`) is what transformers' own
``from_pretrained`` finds: its checkpoint conversion rules for the model (``conversion_mapping``:
renamings, and converters such as per-expert tensors merged into fused experts) run over the stored
names. A merge of per-expert tensors is read box by box (:class:`StackedExperts`); a conversion we
cannot slice is refused by name. Tied weights (``tie_word_embeddings``): a checkpoint stores one of
the pair; the other name reads the same tensor.

Design notes: docs/design-notes.md
"""

import json
import math
import os
import struct
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)
from transformers.modeling_utils import PreTrainedModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Box = tuple[int, ...]


# safetensors' dtype names.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SCRATCH_BYTES = 16 * 2**20


@dataclass(frozen=True, kw_only=True)
class _Stored:
    """Where a tensor's bytes are in its file: the absolute offset of its first byte."""

    dtype: torch.dtype
    shape: Box
    start: int


def _read_header(path: Path) -> tuple[int, dict[str, _Stored]]:
    """A safetensors file's tensors, by name, from its header (8 bytes of length, then JSON)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    stored = {}
    for key, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            name = entry["dtype"]
            raise ValueError(f"{key} in {path}: safetensors dtype {name} is not supported")
        start = 8 + length + entry["data_offsets"][0]
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        stored[key] = _Stored(dtype=dtype, shape=shape, start=start)
    return 8 + length, stored


def _pread_into(fd: int, tensor: torch.Tensor, position: int) -> None:
    """Fill the contiguous CPU ``tensor`` with the bytes of ``fd`` from ``position``."""
    if tensor.device.type != "cpu":
        raise ValueError(f"file bytes are read into CPU memory only, not {tensor.device}")
    view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], position + done)
        if got == 0:
            raise ValueError(f"safetensors file ends {len(view) - done} bytes early")
        done += got


def index_errors(folder: Path) -> list[str]:
    """Why the folder's ``model.safetensors.index.json`` cannot be followed (one phrase each): not a
    ``weight_map`` of names to files, or naming a file outside the folder (``../``, an absolute
    path, a link out) or missing. Nothing when there is no index or it is sound."""
    index = Path(folder) / INDEX_FILE
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        return [f"{index} cannot be read ({str(error).splitlines()[0][:120]})"]
    if not isinstance(weight_map, dict) or not all(
        isinstance(file, str) for file in weight_map.values()
    ):
        return [f"{index} has no weight_map of tensor names to file names"]
    inside, errors = Path(folder).resolve(), []
    for file in sorted(set(weight_map.values())):
        tensor = next(name for name, named in weight_map.items() if named == file)
        path = (Path(folder) / file).resolve()
        if not path.is_relative_to(inside):
            errors.append(
                f"{index} names {file!r} (for {tensor}), outside the model folder: a model's "
                "weights must be files in its own folder"
            )
        elif not path.is_file():
            errors.append(f"{index} names {file!r} (for {tensor}), which does not exist")
    return errors


class Checkpoint:
    """The safetensors files of one Hugging Face folder, open for slice reads while used as a
    context."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.is_file():
            if errors := index_errors(self.folder):
                raise ValueError("; ".join(errors))
            self._file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            self._file_of = dict.fromkeys(_read_header(single)[1], SINGLE_FILE)
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")
        self._files: dict[str, tuple[int, dict[str, _Stored]]] = {}

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def keys(self) -> list[str]:
        """Every stored tensor's name."""
        return list(self._file_of)

    def _stored(self, key: str) -> tuple[int, _Stored]:
        file = self._file_of[key]
        if file not in self._files:
            path = self.folder / file
            _, tensors = _read_header(path)
            self._files[file] = (os.open(path, os.O_RDONLY), tensors)
        fd, tensors = self._files[file]
        if key not in tensors:
            raise KeyError(f"{key} is not in {self.folder / file}, which its index names for it")
        return fd, tensors[key]

    def shape(self, key: str) -> Box:
        return self._stored(key)[1].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._stored(key)[1].dtype

    def read(
        self,
        key: str,
        offset: Box,
        size: Box,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The box of ``key`` that starts at ``offset`` and has ``size``; only its bytes are read.

        ``out``: a contiguous tensor of the box's shape and the stored dtype to read into (no copy).
        """
        fd, stored = self._stored(key)
        shape = stored.shape
        if len(offset) != len(shape) or any(
            o < 0 or n < 0 or o + n > dim for o, n, dim in zip(offset, size, shape, strict=True)
        ):
            raise ValueError(f"{key}: box at {offset} of {size} is outside its shape {shape}")
        box = torch.empty(size, dtype=stored.dtype) if out is None else out
        if (tuple(box.shape), box.dtype) != (tuple(size), stored.dtype) or not box.is_contiguous():
            into = f"{box.dtype} {tuple(box.shape)}"
            raise ValueError(f"{key}: cannot read a {stored.dtype} box of {size} into {into}")
        if box.numel() == 0:
            return box
        if not shape:
            _pread_into(fd, box, stored.start)
            return box
        row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
        first = stored.start + offset[0] * row_bytes
        if tuple(size[1:]) == shape[1:]:  # whole rows: one contiguous run, read in place
            _pread_into(fd, box, first)
            return box
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], size[1:], strict=True))
        rows = max(1, SCRATCH_BYTES // max(1, row_bytes))
        for row in range(0, size[0], rows):
            count = min(rows, size[0] - row)
            scratch = torch.empty((count, *shape[1:]), dtype=stored.dtype)
            _pread_into(fd, scratch, first + row * row_bytes)
            box[row : row + count] = scratch[(slice(None), *inner)]
        return box


class TensorSource(Protocol):
    """Where one model tensor lives in a checkpoint."""

    def describe(self) -> str: ...

    def shape(self, checkpoint: Checkpoint) -> Box: ...

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor: ...

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        """Read the box at ``offset`` of ``out``'s shape straight into ``out``, when the stored
        layout allows it (one stored tensor of ``out``'s dtype, ``out`` contiguous); else False."""
        ...


@dataclass(frozen=True, kw_only=True)
class StoredTensor:
    """A tensor stored whole under one key."""

    key: str

    def describe(self) -> str:
        return self.key

    def shape(self, checkpoint: Checkpoint) -> Box:
        return checkpoint.shape(self.key)

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        return checkpoint.read(self.key, offset, size)

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        """Read in place into a CPU ``out``; a device's ``out`` (CUDA, meta, ...) is filled from a
        host buffer (pinned for CUDA): file bytes only ever land in CPU memory."""
        if out.dtype != checkpoint.dtype(self.key) or not out.is_contiguous():
            return False
        if out.device.type == "cpu":
            checkpoint.read(self.key, offset, tuple(out.shape), out=out)
            return True
        staged = host_buffer(out)
        checkpoint.read(self.key, offset, tuple(out.shape), out=staged)
        out.copy_(staged)  # blocking: the buffer may be reused or freed right after
        return True


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor of ``like``'s shape and dtype to read file bytes into before copying them
    to ``like``'s device; pinned when that device is CUDA (a faster, DMA-able copy)."""
    pinned = like.device.type == "cuda"
    return torch.empty(tuple(like.shape), dtype=like.dtype, pin_memory=pinned)


@dataclass(frozen=True, kw_only=True)
class Concatenated:
    """A tensor stored as ``parts`` concatenated along the first dimension: transformers'
    ``Concatenate(dim=0)`` (a convolution's q, k and v kernels stored apart), or one expert's gate
    and up projections of a fused ``gate_up_proj``."""

    parts: tuple[TensorSource, ...]

    def describe(self) -> str:
        return " + ".join(part.describe() for part in self.parts)

    def shape(self, checkpoint: Checkpoint) -> Box:
        shapes = [part.shape(checkpoint) for part in self.parts]
        if any(len(shape) == 0 or shape[1:] != shapes[0][1:] for shape in shapes):
            raise ValueError(f"{self.describe()}: cannot concatenate shapes {shapes} on their rows")
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        return False  # assembled from several stored tensors

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        pieces, part_start = [], 0
        for part in self.parts:
            part_rows = part.shape(checkpoint)[0]
            low = max(offset[0], part_start)
            high = min(offset[0] + size[0], part_start + part_rows)
            if low < high:
                box = (low - part_start, *offset[1:]), (high - low, *size[1:])
                pieces.append(part.read(checkpoint, *box))
            part_start += part_rows
        return torch.cat(pieces) if pieces else torch.empty(size)


@dataclass(frozen=True, kw_only=True)
class StackedExperts:
    """A fused (experts, rows, columns) parameter stored as 2-D tensors: ``keys[e]`` are expert e's
    parts, concatenated along the rows (gate then up for ``gate_up_proj``; one part for
    ``down_proj``)."""

    keys: tuple[tuple[str, ...], ...]

    def describe(self) -> str:
        return f"{' + '.join(self.keys[0])} (experts 0..{len(self.keys) - 1})"

    def shape(self, checkpoint: Checkpoint) -> Box:
        part_shapes = [checkpoint.shape(key) for key in self.keys[0]]
        for parts in self.keys[1:]:
            if (other := [checkpoint.shape(key) for key in parts]) != part_shapes:
                raise ValueError(
                    f"{' + '.join(parts)}: shapes {other} differ from expert 0's {part_shapes}"
                )
        if any(len(shape) != 2 or shape[1] != part_shapes[0][1] for shape in part_shapes):
            raise ValueError(
                f"{' + '.join(self.keys[0])}: expected 2-D parts with equal columns, got "
                f"{part_shapes}"
            )
        return (len(self.keys), sum(rows for rows, _ in part_shapes), part_shapes[0][1])

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        return False  # assembled from several stored tensors

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        first_expert, experts = offset[0], size[0]
        return torch.stack(
            [
                Concatenated(parts=tuple(StoredTensor(key=key) for key in parts)).read(
                    checkpoint, offset[1:], size[1:]
                )
                for parts in self.keys[first_expert : first_expert + experts]
            ]
        )


@dataclass(frozen=True, kw_only=True)
class Chunked:
    """Chunk ``index`` of ``count`` along the first dimension of the stored tensor ``key``, as
    ``torch.chunk`` cuts it: transformers' ``Chunk(dim=0)`` (a fused q/k/v or gate/up projection
    stored whole, split into the model's projections)."""

    key: str
    index: int
    count: int

    def describe(self) -> str:
        return f"{self.key} (chunk {self.index} of {self.count})"

    def _start_rows(self, checkpoint: Checkpoint) -> tuple[int, int]:
        total = checkpoint.shape(self.key)[0]
        each = -(-total // self.count)
        start = min(self.index * each, total)
        return start, min(each, total - start)

    def shape(self, checkpoint: Checkpoint) -> Box:
        return (self._start_rows(checkpoint)[1], *checkpoint.shape(self.key)[1:])

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        start = self._start_rows(checkpoint)[0]
        return checkpoint.read(self.key, (start + offset[0], *offset[1:]), size)

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        start = self._start_rows(checkpoint)[0]
        return StoredTensor(key=self.key).read_into(
            checkpoint, (start + offset[0], *offset[1:]), out
        )


@dataclass(frozen=True, kw_only=True)
class Interleaved:
    """The stored tensor ``key`` reordered along ``dim`` by transformers' ``Interleave`` (gate
    and up rows stored alternately, read as gate rows then up rows); a box is read whole along
    ``dim`` and reordered by transformers' own operation."""

    key: str
    operation: Interleave

    def describe(self) -> str:
        return f"{self.key} ({self.operation!r})"

    def shape(self, checkpoint: Checkpoint) -> Box:
        return checkpoint.shape(self.key)

    def read_into(self, checkpoint: Checkpoint, offset: Box, out: torch.Tensor) -> bool:
        return False  # reordered after the read

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        dim = self.operation.dim
        whole = checkpoint.shape(self.key)[dim]
        box = [*offset[:dim], 0, *offset[dim + 1 :]], [*size[:dim], whole, *size[dim + 1 :]]
        stored = checkpoint.read(self.key, *map(tuple, box))
        converted = self.operation.convert({self.key: stored}, [self.key], [self.key])
        return converted[self.key].narrow(dim, offset[dim], size[dim]).contiguous()


class UnsupportedLayout(ValueError):
    """Stored tensors that transformers converts in a way this loader cannot read by slices."""


def _conversions(model: nn.Module) -> list:
    """The conversion rules transformers' ``from_pretrained`` applies to ``model``'s checkpoints
    (its class's or model type's, the legacy renamings too); none for a module that is not a
    transformers model."""
    if not isinstance(model, PreTrainedModel):
        return []
    return get_model_conversion_mapping(model, add_legacy=True)


def _is_expert_merge(converter: WeightConverter, parts: int) -> bool:
    """Whether ``converter`` stacks per-expert tensors (``MergeModulelist(dim=0)``) and, for
    several source patterns, concatenates the stacks along their rows (``Concatenate(dim=1)``):
    the conversions :class:`StackedExperts` reads by slices."""
    operations = converter.operations
    merge = (
        bool(operations) and isinstance(operations[0], MergeModulelist) and operations[0].dim == 0
    )
    if len(operations) == 1:
        return merge and parts == 1
    concatenate = isinstance(operations[1], Concatenate) and operations[1].dim == 1
    return merge and len(operations) == 2 and concatenate


def _chunk_targets(converter: WeightConverter, target: str) -> list[str]:
    """The model tensors a ``Chunk(dim=0)`` of one stored tensor makes (``target`` is the first,
    named by ``rename_source_key``), each the next chunk; none for another converter."""
    operations, targets = converter.operations, converter.target_patterns
    if len(operations) != 1 or not isinstance(operations[0], Chunk) or operations[0].dim != 0:
        return []
    if operations[0].num_shards_attribute is not None or len(converter.source_patterns) != 1:
        return []
    return [target.replace(targets[0], other) for other in targets]


class StoredLayout:
    """Where each tensor of one model is stored in ``checkpoint``: every stored name is renamed by
    transformers' conversion rules for the model, in the order and with the base-model prefix
    handling of its ``from_pretrained``; names a converter collects are grouped by model tensor."""

    def __init__(self, checkpoint: Checkpoint, model: nn.Module):
        self.checkpoint = checkpoint
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)
        conversions = _conversions(model)
        renamings = [entry for entry in conversions if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in conversions if isinstance(entry, WeightConverter)]
        names = dict.fromkeys(model.state_dict(), True)
        prefix = getattr(model, "base_model_prefix", None) or None
        self._stored: dict[str, str] = {}
        self._converted: dict[str, tuple[WeightConverter, dict[str, list[str]]]] = {}
        self._stored_chunks: dict[str, Chunked] = {}
        for key in sorted(checkpoint.keys(), key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in names and key in names:  # as from_pretrained: kept under its name
                target, pattern = key, None
            if pattern is None:
                self._stored.setdefault(target, key)
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            for index, chunk in enumerate(_chunk_targets(converter, target)):
                self._stored_chunks[chunk] = Chunked(
                    key=key, index=index, count=len(converter.target_patterns)
                )
            self._converted.setdefault(target, (converter, defaultdict(list)))[1][pattern].append(
                key
            )

    def source(self, name: str, tied: Mapping[str, str]) -> TensorSource:
        """Where the model tensor ``name`` is stored; ``tied`` maps each tied parameter to its
        partner, both ways.

        Raises:
            KeyError: naming the tensor (and what was looked for) if the checkpoint lacks it.
            UnsupportedLayout: if it is stored in a form transformers converts in a way this loader
                does not read (the conversion named).
        """
        if name in self._stored:
            return StoredTensor(key=self._stored[name])
        if name in self._stored_chunks:
            return self._stored_chunks[name]
        if name in self._converted:
            return self._merged(name)
        tried = [name]
        if (partner := tied.get(name)) is not None:
            if partner in self._stored:
                return StoredTensor(key=self._stored[partner])
            tried.append(f"{partner} (tied)")
        folder = self.checkpoint.folder
        raise KeyError(
            f"{name} is not in the checkpoint at {folder} (looked for {', '.join(tried)})"
        )

    def _merged(self, name: str) -> TensorSource:
        converter, keys = self._converted[name]
        parts = [keys[pattern] for pattern in converter.source_patterns if pattern in keys]
        stored = " + ".join(f"{part[0]} (and {len(part) - 1} more)" for part in parts)
        operation = converter.operations[0] if len(converter.operations) == 1 else None
        whole = len(parts) == len(converter.source_patterns) and all(len(p) == 1 for p in parts)
        if isinstance(operation, Concatenate) and operation.dim == 0 and whole:
            return Concatenated(parts=tuple(StoredTensor(key=part[0]) for part in parts))
        if isinstance(operation, Interleave) and whole and len(parts) == 1:
            return Interleaved(key=parts[0][0], operation=operation)
        if not _is_expert_merge(converter, len(parts)):
            operations = ", ".join(map(repr, converter.operations))
            raise UnsupportedLayout(
                f"{name} is stored as {stored}, which transformers converts with {operations}: "
                f"that checkpoint layout of model type {self.model_type!r} is not supported yet "
                "(shardtune reads per-expert tensors merged by MergeModulelist(dim=0), then "
                "Concatenate(dim=1); tensors joined by Concatenate(dim=0); one tensor cut by "
                "Chunk(dim=0) or reordered by Interleave)"
            )
        if len(parts) != len(converter.source_patterns) or len({len(p) for p in parts}) != 1:
            counts = " but ".join(
                f"{len(keys.get(pattern, ()))} of {pattern}"
                for pattern in converter.source_patterns
            )
            raise KeyError(
                f"{name}: the checkpoint at {self.checkpoint.folder} holds {counts}: an expert's "
                "tensor is missing"
            )
        return StackedExperts(keys=tuple(zip(*parts, strict=True)))
