"""A folder shardtune publishes whole (``hf/``, a checkpoint) carries a manifest of its files, so a
later publish or overwrite can refuse instead of deleting the user's own files."""

import json
from pathlib import Path

MANIFEST = ".shardtune-files.json"


def write_manifest(folder: Path) -> None:
    """Record every file now under ``folder`` (relative paths) in
    ``folder/.shardtune-files.json``."""
    files = sorted(
        str(path.relative_to(folder)) for path in Path(folder).rglob("*") if path.is_file()
    )
    (Path(folder) / MANIFEST).write_text(json.dumps(files))


def foreign_files(folder: Path) -> list[str]:
    """Files under ``folder`` that shardtune did not write: not in its manifest (every file, for a
    folder without one). Sorted relative paths; [] if no folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    try:
        ours = set(json.loads((folder / MANIFEST).read_text())) | {MANIFEST}
    except (OSError, ValueError, TypeError):
        ours = set()
    found = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if not path.is_dir())
    return [name for name in found if name not in ours]
