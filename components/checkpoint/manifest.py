"""A folder shardtune publishes whole (``hf/``, a checkpoint) carries a manifest of its files, so a
later publish or overwrite can refuse instead of deleting the user's own files."""

import json
from pathlib import Path

MANIFEST = ".shardtune-files.json"
# Files an export or tokenizer folder written before manifests existed holds; anything else in it is
# the user's.
_EXPORT_NAMES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def write_manifest(folder: Path) -> None:
    """Record every file now under ``folder`` (relative paths) in
    ``folder/.shardtune-files.json``."""
    files = sorted(
        str(path.relative_to(folder)) for path in Path(folder).rglob("*") if path.is_file()
    )
    (Path(folder) / MANIFEST).write_text(json.dumps(files))


def foreign_files(folder: Path) -> list[str]:
    """Files under ``folder`` that shardtune did not write: not in its manifest (or, for a folder
    without a manifest, not one of a Hugging Face export's usual names). Sorted relative paths; []
    if no folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    try:
        ours = set(json.loads((folder / MANIFEST).read_text())) | {MANIFEST}
    except (OSError, ValueError, TypeError):
        ours = None
    found = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if not path.is_dir())
    if ours is None:
        return [name for name in found if name not in _EXPORT_NAMES]
    return [name for name in found if name not in ours]
