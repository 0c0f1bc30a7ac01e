"""``model.pretrained_path`` as a local folder or a Hugging Face Hub id (``owner/name``).

A Hub id is looked up in the local Hugging Face cache first (``HF_HOME`` / ``HF_HUB_CACHE``
honoured, as ``huggingface_hub`` reads them); only when it is not there, and downloads are allowed
and the Hub is not offline (``HF_HUB_OFFLINE``), is it downloaded, and then only safetensors
weights, JSON files, tokenizer and template files (never ``*.bin`` pickles or code: nothing
downloaded is executed). The result is always a plain folder that ``components.models.load`` reads.

In a multi-rank run resolve once in the launching process (which may download), and on the ranks
with ``allow_download=False`` (a cache hit).
"""

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

# What a download fetches: everything a causal LM folder needs to load, train and export.
DOWNLOAD_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "LICENSE*",
    "README*",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """``model.pretrained_path`` cannot be resolved; the message is one line saying why and what to
    do."""


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` has the shape of a Hub repository id, ``owner/name``."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def _cached_snapshot(repo_id: str, cache_dir: Path | None, revision: str | None) -> Path | None:
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, HFValidationError):
        return None
    return Path(folder)


def _download(repo_id: str, cache_dir: Path | None, revision: str | None, key: str) -> Path:
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=DOWNLOAD_PATTERNS
        )
    except Exception as error:  # network, authentication, gated or missing repository: all one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelSourceError(
            f"{key}={repo_id!r} is not a local folder and could not be downloaded from the "
            "Hugging Face Hub: "
            f"{type(error).__name__}: {reason}"
        ) from None
    return Path(folder)


def needs_download(path_or_id: str) -> bool:
    """Whether resolving ``path_or_id`` would download (a Hub id not in the cache, the Hub online):
    an effect, which the recipe's preparation takes, never its checks."""
    if Path(path_or_id).expanduser().is_dir() or not looks_like_hub_id(path_or_id):
        return False
    cached = _cached_snapshot(path_or_id, None, None) is not None
    return not cached and not constants.is_offline_mode()


def resolve_model_folder(
    path_or_id: str,
    *,
    allow_download: bool = True,
    cache_dir: Path | None = None,
    revision: str | None = None,
    key: str = "model.pretrained_path",
) -> Path:
    """The local Hugging Face model folder that ``path_or_id`` names.

    ``path_or_id``: a local folder (``~`` expanded), or a Hub id ``owner/name`` found in the cache
    (``cache_dir``, default the Hugging Face cache) or, when ``allow_download`` and not offline,
    downloaded into it. ``key`` names the config key in error messages.

    Raises:
        ModelSourceError: (a ValueError) one line: not a folder and not a Hub id, not cached while
            offline or downloads are not allowed, the download failed, or the folder has no
            config.json.
    """
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        folder = local
    elif not looks_like_hub_id(path_or_id):
        raise ModelSourceError(
            f"{key}={path_or_id!r} is neither a local folder nor a Hugging Face Hub id (owner/name)"
        )
    elif (cached := _cached_snapshot(path_or_id, cache_dir, revision)) is not None:
        folder = cached
    elif not allow_download or constants.is_offline_mode():
        cache = cache_dir or constants.HF_HUB_CACHE
        raise ModelSourceError(
            f"{key}={path_or_id!r} is not a local folder and is not in the Hugging Face cache "
            "(offline): "
            f"looked in {cache}; download it where a network is (`hf download {path_or_id}`) into "
            "that cache "
            f"(HF_HOME / HF_HUB_CACHE), or set {key} to a local folder"
        )
    else:
        folder = _download(path_or_id, cache_dir, revision, key)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{key}={path_or_id!r}: {not_a_model(folder)}")
    return folder


def not_a_model(folder: Path) -> str:
    """Why ``folder`` (without a config.json) is no model to load: a PEFT adapter alone (what a
    ``peft=lora`` run exports to ``adapter/``) is named as one, with the folder that works."""
    if (folder / "adapter_config.json").is_file():
        return (
            f"the folder {folder} holds a PEFT adapter (adapter_config.json), not a whole model: "
            "give the folder of a whole model, e.g. the hf/ of a run exported with "
            "peft.merge=true (the base with the adapter merged in)"
        )
    return f"the folder {folder} is not a Hugging Face model (no config.json)"
