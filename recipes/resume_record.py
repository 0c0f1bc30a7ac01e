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

FROZEN = "frozen models"  # the run_info key of a recipe's frozen models (matched by weights)


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


def frozen_record(where: str, folder: Path | None, built: Any) -> dict[str, str]:
    """A frozen model's entry in :class:`RecipeRecord`: ``where`` it comes from (said when a resume
    is refused) and its ``weights``: the SHA-256 of its ``folder``'s config.json and weight files'
    contents, or of the settings it is ``built`` from (JSON: its family and config overrides,
    never the layout) with the run's seed, which a resume matches apart."""
    if folder is None:
        parts = json.dumps(built, sort_keys=True, default=str)
    else:
        files = [path for path in sorted(folder.iterdir()) if path.is_file()]
        kept = [p for p in files if p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES]
        parts = json.dumps([(path.name, _file_digest(path)) for path in kept])
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


def _file_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes (well under a second per 100 MB)."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
