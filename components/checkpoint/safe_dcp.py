"""Reading a DCP checkpoint without running code from it, and the project's own state files as JSON.

DCP stores ``.metadata`` as a pickle and non-tensor values (``lr``, ``betas``) as ``torch.save``
blobs read with ``weights_only=False``: a checkpoint from someone else could run any code. Here:

- :func:`read_metadata` unpickles ``.metadata`` admitting only DCP's metadata classes and the
  few torch and standard types they hold; anything else raises :class:`CheckpointError`.
- :class:`SafeFileSystemReader` is DCP's reader with that ``read_metadata``;
  :class:`SafeLoadPlanner` is DCP's default planner reading byte items with ``weights_only=True``.
- :func:`dumps_state` / :func:`loads_state`: JSON that keeps tuples (tagged ``{"__tuple__":
  [...]}``), for the trainer state and RNG states, so those files cannot carry code at all.

Docs: docs/checkpoints.md
"""

import io
import json
import pathlib
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_TUPLE_TAG = "__tuple__"
_UNSUPPORTED_GLOBAL = re.compile(r"unsupported GLOBAL (\S+)")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the checkpoint (or file) and
    the cause."""


def checkpoint_error_in(error: BaseException) -> CheckpointError | None:
    """The :class:`CheckpointError` a rank raised inside ``dcp.load`` (DCP wraps it per rank), or
    None."""
    if isinstance(error, CheckpointError):
        return error
    for wrapped in getattr(error, "failures", {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, CheckpointError):
            return inner
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes and the types they need; refuses every other
    global."""

    def __init__(self, file: io.BufferedReader, name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self._name}: refused to unpickle {module}.{name} (not a DCP metadata type); "
            "the file is damaged or was made to run code"
        )


def read_metadata(path: pathlib.Path) -> Metadata:
    """DCP's ``Metadata`` from the ``.metadata`` file ``path``, unpickled with the restricted
    unpickler.

    Raises:
        CheckpointError: If the file is missing, truncated, not a pickle of DCP metadata, or names a
            global that DCP's metadata never holds (one line naming the file).
    """
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (
        Exception
    ) as error:  # EOFError, UnpicklingError, a constructor refusing its arguments, ...
        raise CheckpointError(
            f"{path} is truncated or not DCP metadata ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` through :func:`read_metadata` (no arbitrary
    unpickling)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(pathlib.Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with
    ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            found = _UNSUPPORTED_GLOBAL.search(str(error))
            reason = f"it would load {found[1]}" if found else " ".join(str(error).split())[:200]
            raise CheckpointError(
                f"value {read_item.dest_index.fqn} is not plain data, refused: {reason}"
            ) from None
        # Hand DCP a blob re-written from the checked value, so its own bookkeeping (flattened keys)
        # applies.
        checked = io.BytesIO()
        torch.save(loaded, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _tag_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_tag_tuples(item) for item in value]}
    if isinstance(value, list):
        return [_tag_tuples(item) for item in value]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str | int):
                raise TypeError(
                    f"a state key must be a str or int to be stored as JSON, got {key!r}"
                )
        return {str(key): _tag_tuples(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"{type(value).__name__} cannot be stored as JSON in a checkpoint: {value!r:.80}"
    )


def _untag(mapping: dict[str, Any]) -> Any:
    if set(mapping) == {_TUPLE_TAG}:
        return tuple(mapping[_TUPLE_TAG])
    return mapping


def dumps_state(state: Any) -> str:
    """``state`` (dicts, lists, tuples, str, int, float, bool, None) as JSON that
    :func:`loads_state` turns back into equal values, tuples included. Integer dict keys come back
    as strings.

    Raises:
        TypeError: If ``state`` holds anything else (a tensor, an object), naming it.
    """
    return json.dumps(_tag_tuples(state))


def loads_state(text: str) -> Any:
    """The value :func:`dumps_state` wrote (JSON only: nothing in it can run code)."""
    return json.loads(text, object_hook=_untag)
