"""What a checkpoint folder holds, whether it is usable, and which one to resume from: no rank, no
torch.distributed.

``root/step_00000042/`` (written by :func:`components.checkpoint.dcp.save_checkpoint`) holds DCP's
``.metadata`` and ``__<rank>_0.distcp`` (read with :mod:`safe_dcp`), ``trainer_state.json`` (rank
0), one ``rng/rank_00000.json`` per rank and the ``COMPLETE`` marker, written last.

:func:`check_checkpoint` validates one folder without loading tensors; :func:`find_resumable` picks
the newest usable checkpoint under a root and says why it passed over newer ones;
:func:`resume_problems` compares its run with this one; :func:`retire_checkpoints_after` hides the
checkpoints after a resume's step (``step_N.abandoned``).

Docs: docs/checkpoints.md
"""

import base64
import binascii
import hashlib
import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from components.checkpoint.safe_dcp import (
    METADATA_FILE,
    CheckpointError,
    loads_state,
    read_metadata,
)
from components.paths import unused_name

MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
RNG_DIR = "rng"
STATE_FORMAT = 1
STEP_FOLDER = re.compile(r"^step_(\d{8,})$")
ABANDONED = ".abandoned"  # suffix of a checkpoint of the branch a resume from an earlier step left
_DCP_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_ZIP_HEADER = b"PK\x03\x04"  # every item DCP writes (torch.save) starts with it
_STATE_KEYS = (
    "format",
    "step",
    "world_size",
    "run_id",
    "run_info",
    "scheduler",
    "extra",
    "optimizer",
)


@dataclass(frozen=True, kw_only=True)
class CheckpointSummary:
    """What a run recorded in a checkpoint: its step, world size, run id and description, and the
    global shape of every model tensor (by state-dict name, from DCP's metadata)."""

    path: Path
    step: int
    world_size: int
    run_id: str | None
    run_info: dict[str, Any]
    parameter_shapes: dict[str, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class ResumeChoice:
    """The checkpoint to resume from (None: none usable) and the newer ones passed over, each with
    its cause."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def checkpoint_path(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step_{step:08d}"


def rng_file(folder: Path, rank: int) -> Path:
    """The file holding ``rank``'s RNG states in the checkpoint ``folder``."""
    return Path(folder) / RNG_DIR / f"rank_{rank:05d}.json"


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` for every ``step_NNNNNNNN`` folder under ``root`` (complete or not),
    oldest first."""
    if not Path(root).is_dir():
        return []
    found = [
        (int(match[1]), child)
        for child in Path(root).iterdir()
        if (match := STEP_FOLDER.match(child.name))
    ]
    return sorted(found)


def complete_checkpoints(root: Path) -> list[Path]:
    """Folders under ``root`` that carry the marker, oldest step first (not validated further)."""
    return [path for _, path in step_folders(root) if (path / MARKER).is_file()]


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The parsed ``trainer_state.json`` of ``folder``.

    Raises:
        CheckpointError: If it is missing, not JSON, or lacks a key (one line naming the file).
    """
    path = Path(folder) / TRAINER_STATE
    try:
        state = loads_state(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{TRAINER_STATE} is missing") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{TRAINER_STATE} is truncated or not JSON ({error})") from None
    if not isinstance(state, dict) or (missing := [key for key in _STATE_KEYS if key not in state]):
        raise CheckpointError(
            f"{TRAINER_STATE} lacks {', '.join(missing) if isinstance(state, dict) else 'a dict'}"
        )
    if state["format"] != STATE_FORMAT:
        raise CheckpointError(
            f"{TRAINER_STATE} has format {state['format']}, this version reads {STATE_FORMAT}"
        )
    if not (
        isinstance(state["step"], int)
        and isinstance(state["world_size"], int)
        and state["world_size"] >= 1
    ):
        raise CheckpointError(f"{TRAINER_STATE} has no valid step and world size")
    extra = state["extra"]
    if not isinstance(extra, dict) or extra.get("step", state["step"]) != state["step"]:
        raise CheckpointError(
            f"{TRAINER_STATE} has an extra that is not a dict or names another step than "
            f"{state['step']}"
        )
    return state


def _read_marker(folder: Path) -> dict[str, Any]:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no {MARKER} marker (a save that did not finish)") from None
    except (ValueError, UnicodeDecodeError):
        marker = None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        raise CheckpointError(f"{MARKER} is not the JSON a finished save writes")
    return marker


def _check_dcp_files(folder: Path) -> dict[str, tuple[int, ...]]:
    """Validate ``.metadata`` and the byte ranges of the ``.distcp`` files; return the model
    tensors' shapes."""
    metadata = read_metadata(folder / METADATA_FILE)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _DCP_FILE.match(name):
            raise CheckpointError(
                f"{METADATA_FILE} names a data file {name!r} outside the checkpoint's own"
            )
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        data = folder / name
        if not data.is_file():
            raise CheckpointError(f"{name} is missing")
        if (actual := data.stat().st_size) < size:
            raise CheckpointError(
                f"{name} is truncated ({actual} bytes, its metadata needs {size})"
            )
    _check_item_headers(folder, metadata.storage_data.values())
    return {
        key.removeprefix("model."): tuple(int(n) for n in value.size)
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(value, TensorStorageMetadata)
    }


def _check_item_headers(folder: Path, items) -> None:
    """Every item's first bytes are a ``torch.save`` (zip) header: a ``.distcp`` overwritten with
    other bytes of the same size is found here, not by the unpickler on a rank."""
    by_file: dict[str, list[int]] = {}
    for info in items:
        if not getattr(info, "transform_descriptors", None):  # compressed items: other headers
            by_file.setdefault(info.relative_path, []).append(int(info.offset))
    for name, offsets in sorted(by_file.items()):
        with open(folder / name, "rb") as data:
            for offset in sorted(offsets):
                data.seek(offset)
                if data.read(len(_ZIP_HEADER)) != _ZIP_HEADER:
                    raise CheckpointError(
                        f"{name} is damaged (no saved tensor at byte {offset}, where its "
                        "metadata puts one)"
                    )


def _check_rng_files(folder: Path, world_size: int) -> None:
    """Every rank's RNG file is there and holds states its generators take (set on throwaway
    generators, so the process's own states are untouched)."""
    for rank in range(world_size):
        path = rng_file(folder, rank)
        name = path.relative_to(folder)
        if not path.is_file() or path.stat().st_size == 0:
            raise CheckpointError(f"{name} is missing or empty")
        try:
            plain = loads_state(path.read_text())
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{name} is truncated or not JSON") from None
        try:
            _try_rng_state(plain)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, binascii.Error):
            raise CheckpointError(f"{name} does not hold the RNG states a save writes") from None


def _try_rng_state(plain: Any) -> None:
    """Raise unless ``plain`` (an RNG file's JSON) holds torch, Python and NumPy states."""
    name, keys, position, has_gauss, cached = plain["numpy"]
    np.random.RandomState().set_state(
        (name, np.array(keys, dtype=np.uint32), position, has_gauss, cached)
    )
    random.Random().setstate(plain["python"])
    torch.Generator().set_state(_bytes_tensor(plain["torch"]))
    if "cuda" in plain and not _bytes_tensor(plain["cuda"]).numel():
        raise ValueError("an empty CUDA state")


def _bytes_tensor(text: Any) -> torch.Tensor:
    if not isinstance(text, str):
        raise TypeError("not base64 text")
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def check_checkpoint(path: Path) -> CheckpointSummary:
    """Validate the checkpoint folder ``path`` without loading tensors and return what it recorded.

    Raises:
        CheckpointError: ``checkpoint <path> is unusable: <cause>`` (one line) for a missing folder,
            a missing or malformed marker or state file, ``.metadata`` that is truncated or holds
            anything but DCP's metadata, a missing, truncated or overwritten ``.distcp`` file (each
            item's header is read), or any rank's RNG file missing or not holding RNG states.
    """
    path = Path(path)
    try:
        if not path.is_dir():
            raise CheckpointError("no such folder")
        if path.name.endswith((".tmp", ".old")):
            raise CheckpointError(f"a {path.suffix} folder is a save that did not finish")
        marker = _read_marker(path)
        state = read_trainer_state(path)
        if marker["step"] != state["step"]:
            raise CheckpointError(
                f"{MARKER} names step {marker['step']}, {TRAINER_STATE} step {state['step']}"
            )
        shapes = _check_dcp_files(path)
        _check_rng_files(path, state["world_size"])
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path} is unusable: {error}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} is unusable: {error.strerror or error}") from None
    run_info = state["run_info"] if isinstance(state["run_info"], dict) else {}
    return CheckpointSummary(
        path=path,
        step=state["step"],
        world_size=state["world_size"],
        run_id=state["run_id"],
        run_info=run_info,
        parameter_shapes=shapes,
    )


def checkpoint_summary(path: Path) -> CheckpointSummary:
    """What the run recorded in the checkpoint ``path`` (same checks as
    :func:`check_checkpoint`)."""
    return check_checkpoint(path)


def find_resumable(root: Path) -> ResumeChoice:
    """The newest usable checkpoint under ``root``, checked newest first with
    :func:`check_checkpoint`.

    Folders named ``step_N`` that fail the check (no marker, damaged files) are passed over and
    listed in ``skipped`` with their cause; ``.tmp`` folders (saves in progress or killed) are
    ignored silently.
    """
    skipped: list[tuple[Path, str]] = []
    for _, folder in reversed(step_folders(root)):
        try:
            check_checkpoint(folder)
        except CheckpointError as error:
            skipped.append((folder, str(error).split(" is unusable: ", 1)[-1]))
            continue
        return ResumeChoice(path=folder, skipped=skipped)
    return ResumeChoice(path=None, skipped=skipped)


def retire_checkpoints_after(root: Path, step: int) -> list[Path]:
    """Move every ``step_N`` folder under ``root`` with N > ``step`` aside to ``step_N.abandoned``
    (``step_N.abandoned_2``, ``_3``, ... where an earlier branch left that name); return the new
    paths. A run resumed from ``step`` is a new branch: the later checkpoints belong to the one it
    left, and ``checkpoint.resume=auto`` must never return to them. They are kept for the user
    (never pruned nor replaced) and go with the run's other files under
    ``overwrite_output_dir=true``."""
    moved = []
    for found, folder in step_folders(root):
        if found > step:
            target = unused_name(folder.with_name(folder.name + ABANDONED))
            os.replace(folder, target)
            moved.append(target)
    return moved


def state_dict_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in ``model``'s state dict (a meta-device model works; DTensors
    report their global shape), keyed as :attr:`CheckpointSummary.parameter_shapes` is."""
    return {
        name: tuple(int(n) for n in tensor.shape) for name, tensor in model.state_dict().items()
    }


def tensor_difference(
    shapes: Mapping[str, Sequence[int]], recorded: Mapping[str, Sequence[int]]
) -> str:
    """The first model tensor (by name) that ``recorded`` (a checkpoint's) lacks, has beside the
    model's, or holds in another shape, as one phrase."""
    for name in sorted(set(shapes) | set(recorded)):
        mine, theirs = shapes.get(name), recorded.get(name)
        if mine is None:
            return f"the model is not the checkpoint's: the checkpoint has {name}, this model not"
        if theirs is None:
            return f"the model is not the checkpoint's: {name} is not in the checkpoint"
        if list(mine) != list(theirs):
            return (
                f"the model is not the checkpoint's: {name} is {list(mine)} here but "
                f"{list(theirs)} in the checkpoint"
            )
    return "the model is not the checkpoint's (the same tensors, recorded under another hash)"


def model_fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    """A short stable hash of tensor names and global shapes (for ``run_info``)."""
    canonical = json.dumps({name: list(shape) for name, shape in sorted(shapes.items())})
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# run_info keys that checkpoints written before them lack: those are not refused for them.
LATER_KEYS = (
    "seed",
    "data.val_fraction",
    "data",
    "peft",
    "data.loss_on",
    "recipe",
    "data.sources' val_fraction",
)


def _another_recipe(summary: CheckpointSummary, recorded: str, recipe: str) -> str:
    """Why ``recipe`` does not resume ``recorded``'s checkpoint (``summary``), and what does: that
    recipe resumes it; this one starts from its run's export (``hf/`` beside ``checkpoints/``)."""
    export = summary.path.parent.parent / "hf"
    return (
        f"the checkpoint is a {recorded} run's, not a {recipe} one's: resume it with {recorded}; "
        f"to start {recipe} from its weights, give its run's export as a model "
        f"(model=pretrained model.pretrained_path={export}, written when that run ends)"
    )


def resume_problems(
    summary: CheckpointSummary,
    expected: Mapping[str, Any],
    max_steps: int,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> list[str]:
    """Why the run described by ``expected`` (the ``run_info`` it would save) and ``max_steps``
    cannot resume from ``summary``: one phrase per key whose recorded value differs (the model by
    its first differing tensor when its ``shapes`` are given), and one if ``max_steps`` is not
    beyond the checkpoint's step. Empty when it can."""
    recipe, recorded_recipe = expected.get("recipe"), summary.run_info.get("recipe")
    if recipe is not None and recorded_recipe is not None and recipe != recorded_recipe:
        return [_another_recipe(summary, recorded_recipe, recipe)]  # its other keys: beside it
    problems = []
    for key, value in expected.items():
        if key in LATER_KEYS and key not in summary.run_info:
            continue
        recorded = summary.run_info.get(key, "<not recorded>")
        if recorded == value:
            continue
        if key == "model" and shapes is not None:
            problems.append(tensor_difference(shapes, summary.parameter_shapes))
        elif key == "data" and isinstance(recorded, dict) and isinstance(value, dict):
            now, then = value.get("source"), recorded.get("source")
            problems.append(
                f"the data ({now}) has changed since the checkpoint was trained on it"
                if now == then
                else f"the data is {now}, not the {then} the checkpoint was trained on"
            )
        elif key == "tokenizer":
            problems.append(
                "the tokenizer is not the checkpoint's (its vocabulary, merges, chat template or "
                "special tokens differ; a tokenizer trained on the data follows the data)"
            )
        else:
            problems.append(f"{key} is {value!r} but the checkpoint was written with {recorded!r}")
    if max_steps <= summary.step:
        problems.append(
            f"max_steps {max_steps} is not beyond the checkpoint's step {summary.step}: nothing "
            "to train"
        )
    return problems
