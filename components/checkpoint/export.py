"""Export a (tensor- or data-parallel) model as a Hugging Face folder that ``from_pretrained``
loads.

Every rank writes its share of the whole tensors (assigned by size) into ``<out_dir>.tmp``; each
tensor comes to its writer in row blocks, sent by the ranks holding them to it alone, so no rank
holds more than its shard plus about one block. Then rank 0 writes the safetensors index (one
process under ``max_shard_size``: ``model.safetensors``) in the requested ``dtype``,
``config.json``, the tokenizer when one is given, every other top-level file of the source model
folder byte-identical, and a ``README.md`` model card.

``publish_folder`` adds the manifest and renames the folder to ``out_dir``; an existing ``out_dir``
holding anything an earlier export did not write is refused with a ValueError, untouched.

Docs: docs/checkpoints.md
"""

import copy
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub.serialization._base import parse_size_to_int
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PretrainedConfig, PreTrainedModel

from components.checkpoint.dcp import publish_folder, rank_and_world, run_on_rank0
from components.checkpoint.manifest import foreign_files
from components.models.hub import looks_like_hub_id

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CARD = "README.md"
# Files of a source model folder that the export writes itself or that hold weights: never copied.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
)
_NOT_COPIED = ("config.json", CARD)
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tied_duplicates(model: nn.Module) -> set[str]:
    """Names of parameters that are the same object as an earlier one (``lm_head.weight`` when
    tied).

    Hugging Face checkpoints store a tied pair once, under the first name, and re-tie on load.
    """
    first: dict[nn.Parameter, str] = {}  # tensors hash by identity
    duplicates = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(parameter, name) != name:
            duplicates.add(name)
    # a pipeline's last stage holds the head of a tie alone: the first stage writes the weight
    return duplicates | set(getattr(model, "all_tied_weights_keys", None) or ())


def _architecture(model: nn.Module) -> str | None:
    """The Hugging Face class name of ``model``, also when FSDP2 has swapped in a subclass of it."""
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and cls.__module__.startswith("transformers."):
            return cls.__name__
    return None


def source_dtype(source_dir: Path | None) -> torch.dtype:
    """The dtype of the weights in the Hugging Face folder ``source_dir`` (``dtype``, or the older
    ``torch_dtype``, in its config.json); float32 when there is no folder or it names none."""
    if source_dir is None:
        return torch.float32
    config = json.loads((Path(source_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_dtype(name: str | None, source_dir: Path | None) -> torch.dtype:
    """The dtype an export writes: ``name`` (``float32``, ``bfloat16`` or ``float16``), or for None
    the source folder's (:func:`source_dtype`).

    Raises:
        ValueError: One line naming the accepted values, for any other name.
    """
    if name is None:
        return source_dtype(source_dir)
    if name not in EXPORT_DTYPES:
        raise ValueError(
            f"export dtype {name!r} is not one of null (the source's), {', '.join(EXPORT_DTYPES)}"
        )
    return EXPORT_DTYPES[name]


def metadata_files(source_dir: Path) -> list[Path]:
    """The top-level files of ``source_dir`` an export copies: all but weights, index files,
    config.json, README.md and hidden files. Symbolic links (a Hub cache snapshot) count as the
    files they point to."""
    kept = []
    for path in sorted(Path(source_dir).iterdir()):
        name = path.name
        weights = name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
        if path.is_file() and not weights and name not in _NOT_COPIED and not name.startswith("."):
            kept.append(path)
    return kept


def check_export_target(out_dir: Path) -> str | None:
    """Why ``out_dir`` may not receive an export (it holds files no earlier export wrote), or
    None."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return (
            f"export folder {out_dir} exists and is not a folder; "
            "move it away or choose another output_dir"
        )
    foreign = foreign_files(out_dir)
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (
        f"export folder {out_dir} holds files shardtune did not write ({shown}); "
        "move them away or choose another output_dir"
    )


def model_card(
    recipe: str | None, config_yaml: str | None, base_model: str | None, dtype: torch.dtype
) -> str:
    """A short README.md: Hub metadata, where the model came from, and the config it was trained
    with."""
    front = ["---", "library_name: transformers", "tags:", "- shardtune"]
    if base_model and looks_like_hub_id(
        base_model
    ):  # the Hub links a base model by id, not by local path
        front.append(f"base_model: {json.dumps(base_model)}")
    lines = [*front, "---", "", "# Fine-tuned with shardtune", ""]
    lines.append(f"- Recipe: `{recipe}`" if recipe else "- Recipe: not recorded")
    lines.append(
        f"- Base model: `{base_model}`"
        if base_model
        else "- Base model: built from its config (random init)"
    )
    lines.append(f"- Weights: {str(dtype).removeprefix('torch.')} safetensors")
    load = "AutoModelForCausalLM.from_pretrained(<this folder>, trust_remote_code=False)"
    lines += ["", f"Load it with `{load}`.", ""]
    if config_yaml:
        lines += [
            "## Config",
            "",
            "The composed config of the run:",
            "",
            "```yaml",
            config_yaml.rstrip("\n"),
            "```",
            "",
        ]
    return "\n".join(lines)


# safetensors' names of the dtypes a model's state may hold.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """One tensor as the export writes it: its name, global shape and written dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class _Part:
    """One safetensors file of the export: the rank writing it, its tensors in gather order."""

    filename: str
    rank: int
    entries: tuple[_Entry, ...]


def _entries(
    state: dict[str, torch.Tensor],
    duplicates: set[str],
    dtype: torch.dtype,
) -> list[_Entry]:
    """What is written, in the state dict's order: tied duplicates left out, floating tensors as
    ``dtype``."""
    return [
        _Entry(
            name=name,
            shape=tuple(tensor.shape),
            dtype=dtype if tensor.is_floating_point() else tensor.dtype,
        )
        for name, tensor in state.items()
        if name not in duplicates
    ]


def _every_ranks_entries(entries: list[_Entry]) -> tuple[list[_Entry], dict[str, set] | None]:
    """Every rank's ``entries`` in one list (in rank order, each name once), and the ranks holding
    each, from one exchange; None for the holders when every rank holds every tensor (no pipeline
    stages: the model whole on each rank, or sharded over all of them)."""
    rank, world = rank_and_world()
    if world == 1:
        return entries, None
    every: list = [None] * world
    dist.all_gather_object(every, entries)
    union: dict[str, _Entry] = {}
    holders: dict[str, set] = {}
    for other, held in enumerate(every):
        for entry in held:
            union.setdefault(entry.name, entry)
            holders.setdefault(entry.name, set()).add(other)
    if all(len(ranks) == world for ranks in holders.values()):
        return entries, None
    return list(union.values()), holders


def _plan_parts(
    entries: list[_Entry],
    world_size: int,
    max_shard_bytes: int,
    holders: dict[str, set] | None = None,
) -> list[_Part]:
    """Which rank writes which tensor into which file; the same on every rank (no communication).

    Largest tensor first, each to the rank with the fewest bytes so far (the lowest rank on a tie)
    among the ranks that hold it (``holders``: name -> ranks; None: all of them);
    a rank's tensors keep the gather order and are split into files of at most ``max_shard_bytes``
    (a bigger tensor gets a file of its own). Files are numbered rank by rank; a lone file is
    ``model.safetensors``.
    """
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for index in sorted(range(len(entries)), key=lambda i: (-entries[i].nbytes, i)):
        name = entries[index].name
        ranks = range(world_size) if holders is None else sorted(holders[name])
        rank = min(ranks, key=lambda r: (load[r], r))
        owned[rank].append(index)
        load[rank] += entries[index].nbytes
    chunks: list[tuple[int, list[_Entry]]] = []
    for rank, indices in enumerate(owned):
        chunk: list[_Entry] = []
        size = 0
        for index in sorted(indices):
            entry = entries[index]
            if chunk and size + entry.nbytes > max_shard_bytes:
                chunks.append((rank, chunk))
                chunk, size = [], 0
            chunk.append(entry)
            size += entry.nbytes
        if chunk:
            chunks.append((rank, chunk))
    if len(chunks) == 1:
        return [_Part(filename=SINGLE_FILE, rank=chunks[0][0], entries=tuple(chunks[0][1]))]
    total = len(chunks)
    return [
        _Part(
            filename=f"model-{number:05d}-of-{total:05d}.safetensors",
            rank=rank,
            entries=tuple(chunk),
        )
        for number, (rank, chunk) in enumerate(chunks, start=1)
    ]


class _PartWriter:
    """A safetensors file written block by block: the header (every shape and dtype known in
    advance) first, then each tensor's bytes in row blocks as they arrive, in the header's order;
    fsynced on close."""

    def __init__(self, path: Path, entries: tuple[_Entry, ...]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in entries:
            if entry.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{entry.name}: cannot export dtype {entry.dtype} as safetensors")
            end = offset + entry.nbytes
            header[entry.name] = {
                "dtype": _SAFETENSORS_DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self._pending = list(reversed(entries))
        self._current: _Entry | None = None
        self._left = 0  # bytes of the current tensor still to come
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, entry: _Entry, block: torch.Tensor) -> None:
        """Append ``block``: the next rows of ``entry`` (all of it, for a tensor of < 2 dims)."""
        if self._left == 0:  # a new tensor starts
            expected = self._pending.pop() if self._pending else None
            if expected != entry:
                raise RuntimeError(
                    f"{entry.name}: written out of order; the header says {expected}"
                )
            self._current, self._left = entry, entry.nbytes
        if (
            entry != self._current
            or block.dtype != entry.dtype
            or block.shape[1:] != entry.shape[1:]
        ):
            raise RuntimeError(f"{entry.name}: a block of {tuple(block.shape)} {block.dtype}")
        size = block.numel() * block.element_size()
        if size > self._left or (size == 0 and self._left):
            raise RuntimeError(f"{entry.name}: {size} bytes written where {self._left} were left")
        if size:
            self._file.write(block.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._left -= size

    def close(self) -> None:
        try:
            if self._pending or self._left:
                raise RuntimeError(f"{self._file.name}: {len(self._pending)} tensors never written")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


# Rows of a tensor sent to its writer at a time: a rank holds its shard plus about one block.
_BLOCK_BYTES = 4 * 1024**2


@dataclass(frozen=True, kw_only=True)
class _Box:
    """The part of a tensor one rank holds: ``shape`` rows, columns, ... from ``offset``."""

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def _boxes(state: dict[str, torch.Tensor], entries: list[_Entry]) -> dict[str, list[_Box]]:
    """For each sharded tensor, the distinct boxes the ranks hold (a replica's lowest rank), from
    one exchange of every rank's boxes; a tensor whose boxes do not tile it is left out (gathered
    whole instead)."""
    rank, world = rank_and_world()
    local = {}
    for entry in entries:
        tensor = state.get(entry.name)  # None: another pipeline stage's
        if isinstance(tensor, DTensor) and tensor.ndim > 0:
            shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            local[entry.name] = (tuple(offset), tuple(shape))
    every: list = [None] * world
    dist.all_gather_object(every, local)
    boxes = {}
    for name in local:
        found: dict[tuple, _Box] = {}
        for other, held in enumerate(every):
            if name in held and torch.Size(held[name][1]).numel() > 0:
                offset, shape = held[name]
                found.setdefault((offset, shape), _Box(rank=other, offset=offset, shape=shape))
        shape = state[name].shape
        inside = all(
            len(box.offset) == len(shape)
            and all(
                0 <= o and o + n <= d for o, n, d in zip(box.offset, box.shape, shape, strict=True)
            )
            for box in found.values()
        )
        if inside and sum(torch.Size(box.shape).numel() for box in found.values()) == shape.numel():
            boxes[name] = list(found.values())
    return boxes


def _row_blocks(entry: _Entry):
    rows = entry.shape[0]
    row_bytes = max(1, entry.nbytes // max(rows, 1))
    step = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _gathered_blocks(tensor: DTensor, entry: _Entry, owner: int, boxes: list[_Box], rank: int):
    """Row blocks of ``tensor`` as ``entry.dtype`` on ``owner`` (None on the others): each box's
    rows of a block are sent by the rank holding them to the owner alone (point-to-point, in the
    same order on every rank)."""
    local = tensor.to_local()
    for start, end in _row_blocks(entry):
        block = None
        if rank == owner:
            block = torch.empty((end - start, *entry.shape[1:]), dtype=entry.dtype)
            block = block.to(local.device)
        for box in boxes:
            first, last = max(start, box.offset[0]), min(end, box.offset[0] + box.shape[0])
            if first >= last or rank not in (box.rank, owner):
                continue
            rows = slice(first - start, last - start)
            where = (
                rows,
                *(slice(o, o + n) for o, n in zip(box.offset[1:], box.shape[1:], strict=True)),
            )
            if box.rank == rank:
                piece = local[first - box.offset[0] : last - box.offset[0]].to(entry.dtype)
                if rank == owner:
                    block[where] = piece
                else:
                    dist.send(piece.contiguous(), dst=owner)
            else:
                piece = torch.empty((last - first, *box.shape[1:]), dtype=entry.dtype)
                piece = piece.to(local.device)
                dist.recv(piece, src=box.rank)
                block[where] = piece
            del piece
        yield None if block is None else block.cpu()


def _write_parts(
    state: dict[str, torch.Tensor],
    entries: list[_Entry],
    parts: list[_Part],
    folder: Path,
    rank: int,
) -> Exception | None:
    """Write this rank's parts: every sharded tensor comes to its writer in row blocks
    (:func:`_gathered_blocks`), every rank taking part in every tensor's exchange in ``entries``'
    order.

    A failure on this rank (a full disk) stops its writing but not its part in the exchanges, so no
    rank is left waiting; it is returned, for every rank to learn of it.
    """
    mine = [part for part in parts if part.rank == rank]
    owner_of = {entry.name: part.rank for part in parts for entry in part.entries}
    part_of = {entry.name: index for index, part in enumerate(mine) for entry in part.entries}
    boxes = _boxes(state, entries) if dist.is_initialized() else {}
    writers: dict[int, _PartWriter] = {}
    failure: Exception | None = None
    for entry in entries:
        if entry.name not in state:  # another pipeline stage's: its ranks exchange it
            continue
        tensor = state[entry.name].detach()
        owner = owner_of[entry.name]
        if entry.name in boxes:
            blocks = _gathered_blocks(tensor, entry, owner, boxes[entry.name], rank)
        else:  # a plain tensor (whole on every rank), or a DTensor gathered whole
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # a collective
            blocks = iter([full.cpu().to(entry.dtype)] if rank == owner else [])
        index = part_of.get(entry.name)
        for block in blocks:
            if block is None or index is None or failure is not None:
                continue
            try:
                if index not in writers:
                    for earlier in [i for i in writers if i < index]:
                        writers.pop(earlier).close()  # a rank's files fill one after the other
                    writers[index] = _PartWriter(folder / mine[index].filename, mine[index].entries)
                writers[index].write(entry, block)
            except Exception as error:
                failure = error
            del block
    for writer in writers.values():
        try:
            writer.close()
        except Exception as error:
            failure = failure or error
    return failure


def _raise_if_any_failed(failure: Exception | None) -> None:
    """Every rank raises when any failed: its own exception, or a RuntimeError quoting the first
    failed rank's."""
    rank, world = rank_and_world()
    if world > 1:
        failures: list = [None] * world
        text = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(failures, text)
        first = next(((r, text) for r, text in enumerate(failures) if text is not None), None)
        if first is not None and failure is None:
            raise RuntimeError(f"rank {first[0]} failed: {first[1]}")
    if failure is not None:
        raise failure


def _write_index(parts: list[_Part], folder: Path) -> None:
    if len(parts) == 1:
        return
    weight_map = {entry.name: part.filename for part in parts for entry in part.entries}
    total = sum(entry.nbytes for part in parts for entry in part.entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def _write_metadata(folder: Path, config, tokenizer, source_dir, card: str) -> None:
    """Everything of one export but the weights into ``folder``."""
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for path in metadata_files(source_dir) if source_dir is not None else []:
        shutil.copyfile(
            path, folder / path.name
        )  # follows links: a Hub cache snapshot holds links to blobs
    (folder / CARD).write_text(card)


def export_hf(
    model: nn.Module,
    config: PretrainedConfig,
    out_dir: Path,
    tokenizer=None,
    max_shard_size: str = "5GB",
    *,
    dtype: torch.dtype | None = None,
    source_dir: Path | None = None,
    recipe: str | None = None,
    config_yaml: str | None = None,
    base_model: str | None = None,
) -> Path:
    """Write ``model``'s full weights as ``dtype``, ``config``, ``tokenizer`` (anything with
    ``save_pretrained``), the metadata files of ``source_dir`` (the Hugging Face folder the model
    was loaded from, or None) and a model card naming ``recipe``, ``base_model`` and ``config_yaml``
    (the composed config as text) as a Hugging Face folder at ``out_dir``; return it.

    ``dtype`` None means the source's (:func:`source_dtype`). Collective when a process group exists
    (every rank calls it and writes its part of the weights; rank 0 the rest, and publishes the
    folder once all parts are written); a plain model in a single process needs none. Tied
    parameters are written once under their first name. ``config`` is copied, not changed; its
    ``architectures`` is filled in from the model when missing (vLLM needs it).

    Raises:
        ValueError: Before any gathering, when ``out_dir`` holds files no export wrote
            (:func:`check_export_target`); nothing is changed then. Rank 0 raises the ValueError,
            the other ranks a RuntimeError quoting it (``run_on_rank0``).
        Exception: A rank that fails to write its part raises its error after the last gather,
            the others a RuntimeError quoting it; nothing is published then.
    """
    out_dir = Path(out_dir)
    dtype = dtype if dtype is not None else source_dtype(source_dir)

    def check() -> None:
        if problem := check_export_target(out_dir):
            raise ValueError(problem)

    run_on_rank0(check)
    duplicates = _tied_duplicates(model)
    # The rank-local state (no DTensor gathered here), under the names a full state dict has.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # as save_pretrained
    state = {name: tensor for name, tensor in state.items() if name not in ignored}
    entries, holders = _every_ranks_entries(_entries(state, duplicates, dtype))
    rank, world = rank_and_world()
    parts = _plan_parts(entries, world, parse_size_to_int(max_shard_size), holders)
    config = copy.deepcopy(config)
    config.dtype = dtype
    if not getattr(config, "architectures", None) and (architecture := _architecture(model)):
        config.architectures = [architecture]
    card = model_card(recipe, config_yaml, base_model, dtype)
    tmp = out_dir.with_name(out_dir.name + ".tmp")

    def prepare() -> None:
        check()
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crashed export
        tmp.mkdir(parents=True)

    run_on_rank0(prepare)
    _raise_if_any_failed(_write_parts(state, entries, parts, tmp, rank))

    def finish() -> None:
        _write_index(parts, tmp)
        _write_metadata(tmp, config, tokenizer, source_dir, card)
        publish_folder(tmp, out_dir)

    run_on_rank0(finish)
    return out_dir
