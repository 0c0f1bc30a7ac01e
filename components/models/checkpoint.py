"""Read any slice of a model tensor from a Hugging Face safetensors folder, touching only that slice's bytes.

Most tensors are stored under the model's own parameter name. Two exceptions, both found by checking
what transformers 5.23 does:

- Fused experts. Qwen3-MoE and Mixtral hold each layer's experts as two 3-D parameters,
  ``mlp.experts.gate_up_proj`` (experts, 2 * intermediate, hidden: gate rows, then up rows) and
  ``mlp.experts.down_proj``, but ``save_pretrained`` writes (and the Hub's checkpoints hold) one 2-D
  tensor per expert, Mixtral's under ``block_sparse_moe.experts.<e>.w1/w3/w2``. A slice of a fused
  parameter is assembled from slices of the per-expert tensors, so a rank still reads only its part.
- Tied weights. A checkpoint of a model with ``tie_word_embeddings`` stores one of the pair (SmolLM2
  stores ``model.embed_tokens.weight`` and no ``lm_head.weight``); the other name reads the same tensor.
"""

import json
import re
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from components.models.families import FAMILIES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FUSED_EXPERTS = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")

Box = tuple[int, ...]


class Checkpoint:
    """The safetensors files of one Hugging Face folder, open for slice reads while used as a context."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.is_file():
            self._file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, framework="pt") as handle:
                self._file_of = dict.fromkeys(handle.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()
        self._handles.clear()

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def _handle(self, key: str):
        file = self._file_of[key]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(self.folder / file, framework="pt"))
        return self._handles[file]

    def shape(self, key: str) -> Box:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, offset: Box, size: Box) -> torch.Tensor:
        """The box of ``key`` that starts at ``offset`` and has ``size``; only its bytes are read."""
        if not size:
            return self._handle(key).get_tensor(key)
        return self._handle(key).get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]


class TensorSource(Protocol):
    """Where one model tensor lives in a checkpoint."""

    def describe(self) -> str: ...

    def shape(self, checkpoint: Checkpoint) -> Box: ...

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor: ...


@dataclass(frozen=True)
class StoredTensor:
    """A tensor stored whole under one key."""

    key: str

    def describe(self) -> str:
        return self.key

    def shape(self, checkpoint: Checkpoint) -> Box:
        return checkpoint.shape(self.key)

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        return checkpoint.read(self.key, offset, size)


@dataclass(frozen=True)
class StackedExperts:
    """A fused (experts, rows, columns) parameter stored as 2-D tensors: ``keys[e]`` are expert e's parts,
    concatenated along the rows (gate then up for ``gate_up_proj``; one part for ``down_proj``)."""

    keys: tuple[tuple[str, ...], ...]

    def describe(self) -> str:
        return f"{' + '.join(self.keys[0])} (experts 0..{len(self.keys) - 1})"

    def shape(self, checkpoint: Checkpoint) -> Box:
        part_shapes = [checkpoint.shape(key) for key in self.keys[0]]
        for parts in self.keys[1:]:
            if (other := [checkpoint.shape(key) for key in parts]) != part_shapes:
                raise ValueError(f"{' + '.join(parts)}: shapes {other} differ from expert 0's {part_shapes}")
        if any(len(shape) != 2 or shape[1] != part_shapes[0][1] for shape in part_shapes):
            raise ValueError(f"{' + '.join(self.keys[0])}: expected 2-D parts with equal columns, got {part_shapes}")
        return (len(self.keys), sum(rows for rows, _ in part_shapes), part_shapes[0][1])

    def read(self, checkpoint: Checkpoint, offset: Box, size: Box) -> torch.Tensor:
        (first_expert, first_row, first_column), (experts, rows, columns) = offset, size
        stacked = []
        for parts in self.keys[first_expert : first_expert + experts]:
            pieces, part_start = [], 0
            for key in parts:
                part_rows = checkpoint.shape(key)[0]
                low, high = max(first_row, part_start), min(first_row + rows, part_start + part_rows)
                if low < high:
                    pieces.append(checkpoint.read(key, (low - part_start, first_column), (high - low, columns)))
                part_start += part_rows
            stacked.append(torch.cat(pieces))
        return torch.stack(stacked)


def find_source(
    checkpoint: Checkpoint, name: str, model_shape: Box, model_type: str | None, tied: Mapping[str, str]
) -> TensorSource:
    """Where the model tensor ``name`` (global shape ``model_shape``) is stored in ``checkpoint``.

    ``tied`` maps each tied parameter name to its partner, both ways. Raises KeyError naming the tensor
    (and what was looked for) if the checkpoint does not hold it.
    """
    if name in checkpoint:
        return StoredTensor(name)
    tried = [name]
    family = FAMILIES.get(model_type or "")
    if family is not None and family.per_expert_checkpoint is not None:
        block, gate, up, down = family.per_expert_checkpoint
        if match := _FUSED_EXPERTS.match(name):
            prefix = f"{match['layer']}.{block}.experts"
            parts = (gate, up) if match["which"] == "gate_up_proj" else (down,)
            keys = tuple(tuple(f"{prefix}.{e}.{part}.weight" for part in parts) for e in range(model_shape[0]))
            if all(key in checkpoint for expert in keys for key in expert):
                return StackedExperts(keys)
            tried.append(f"{prefix}.<0..{model_shape[0] - 1}>.{'/'.join(parts)}.weight")
        elif (renamed := name.replace(".mlp.", f".{block}.")) != name:
            if renamed in checkpoint:
                return StoredTensor(renamed)
            tried.append(renamed)
    if (partner := tied.get(name)) is not None:
        if partner in checkpoint:
            return StoredTensor(partner)
        tried.append(f"{partner} (tied)")
    raise KeyError(f"{name} is not in the checkpoint at {checkpoint.folder} (looked for {', '.join(tried)})")
