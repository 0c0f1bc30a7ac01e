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
    Concatenate,
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
        (first_expert, first_row, first_column), (experts, rows, columns) = offset, size
        stacked = []
        for parts in self.keys[first_expert : first_expert + experts]:
            pieces, part_start = [], 0
            for key in parts:
                part_rows = checkpoint.shape(key)[0]
                low, high = (
                    max(first_row, part_start),
                    min(first_row + rows, part_start + part_rows),
                )
                if low < high:
                    pieces.append(
                        checkpoint.read(
                            key, (low - part_start, first_column), (high - low, columns)
                        )
                    )
                part_start += part_rows
            stacked.append(torch.cat(pieces))
        return torch.stack(stacked)


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
        for key in sorted(checkpoint.keys(), key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in names and key in names:  # as from_pretrained: kept under its name
                target, pattern = key, None
            if pattern is None:
                self._stored.setdefault(target, key)
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
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

    def _merged(self, name: str) -> "StackedExperts":
        converter, keys = self._converted[name]
        parts = [keys[pattern] for pattern in converter.source_patterns if pattern in keys]
        stored = " + ".join(f"{part[0]} (and {len(part) - 1} more)" for part in parts)
        if not _is_expert_merge(converter, len(parts)):
            operations = ", ".join(map(repr, converter.operations))
            raise UnsupportedLayout(
                f"{name} is stored as {stored}, which transformers converts with {operations}: "
                f"that checkpoint layout of model type {self.model_type!r} is not supported yet "
                "(shardtune reads per-expert tensors merged by MergeModulelist(dim=0), then "
                "Concatenate(dim=1))"
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
