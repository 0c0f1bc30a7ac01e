"""What a recipe's own parts add to its checkpoints' record (``recipes/outputs.py``'s
``run_info``): its frozen models, which a resume must keep, and its loss's settings, which a resume
may change with a ``note:``. Light (no torch, no datasets): the recipes' checks import it before
the schema has passed.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.runtime.output_dir import write_whole

FROZEN = "frozen models"  # the run_info key of a recipe's frozen models (matched by weights)
# the folder of cache_dir that keeps frozen models' files' digests, so that a run hashes once
DIGESTS = "frozen-digests"


@dataclass(frozen=True, kw_only=True)
class RecipeRecord:
    """What a recipe's own parts add to its checkpoints' record: its frozen models (``{name:
    frozen_record(...)}``: DPO's reference, distillation's teacher), which a resume must keep (a
    different one is another objective), and its loss's settings (``{key: value}``: ``dpo.beta``,
    ``distill.alpha``, ...), which a resume may change, said in a ``note:``."""

    frozen: dict[str, dict[str, str]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


# the files of a Hugging Face model folder that make its weights: a frozen model's identity
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def frozen_record(where: str, folder: Path | None, built: Any, cache_dir: Path) -> dict[str, str]:
    """A frozen model's entry in :class:`RecipeRecord`: ``where`` it comes from (said when a resume
    is refused) and its ``weights``: the SHA-256 of its ``folder``'s config.json and weight files'
    contents (each file's digest cached in ``cache_dir``: :func:`_file_digest`), or of the settings
    it is ``built`` from (JSON: its family and config overrides, never the layout) with the run's
    seed, which a resume matches apart."""
    if folder is None:
        parts = json.dumps(built, sort_keys=True, default=str)
    else:
        files = [path for path in sorted(folder.iterdir()) if path.is_file()]
        kept = [p for p in files if p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES]
        digests = Path(cache_dir) / DIGESTS
        parts = json.dumps([(path.name, _file_digest(path, digests)) for path in kept])
    return {"from": where, "weights": hashlib.sha256(parts.encode()).hexdigest()[:16]}


def frozen_problems(recorded: Any, now: dict[str, dict[str, str]]) -> list[str]:
    """Why a run with the frozen models ``now`` cannot resume a checkpoint trained against
    ``recorded`` (nothing for a checkpoint written before the record): one phrase per model whose
    weights differ, or that one side lacks."""
    if not isinstance(recorded, dict):
        return []
    found = []
    for name in sorted(set(recorded) | set(now)):
        then, mine = recorded.get(name) or {}, now.get(name) or {}
        if then.get("weights") == mine.get("weights"):
            continue
        here = f"{mine['from']}, weights {mine['weights']}" if mine else "none in this run"
        there = f"{then['from']}, weights {then['weights']}" if then else "none"
        found.append(
            f"the {name} ({here}) is not the one the checkpoint was trained against ({there}): "
            f"another {name} is another objective; resume with the checkpoint's, or train in a "
            "new output_dir"
        )
    return found


def _file_digest(path: Path, digests: Path) -> str:
    """The SHA-256 of ``path``'s bytes (well under a second per 100 MB, minutes for a 70B folder),
    read from ``digests`` when the file's resolved path, size and mtime are the ones it was hashed
    at; else hashed and kept there (not when the file changed while it was read)."""
    key = _file_key(path)
    entry = digests / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.json"
    if (kept := _kept_digest(entry, key)) is not None:
        return kept
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    if _file_key(path) == key:
        digests.mkdir(parents=True, exist_ok=True)
        write_whole(entry, json.dumps({"file": key, "sha256": digest}))
    return digest


def _file_key(path: Path) -> list:
    """What a cached digest of ``path`` is kept under: its resolved path, size and mtime (ns)."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _kept_digest(entry: Path, key: list) -> str | None:
    """The digest ``entry`` keeps for the file of ``key``; None when there is none (or another
    file's, or an unreadable entry: hashed again and written over)."""
    try:
        kept = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    return kept.get("sha256") if isinstance(kept, dict) and kept.get("file") == key else None
