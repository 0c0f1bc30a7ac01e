"""A frozen model's record (``recipes/resume_record.py``): the digest of its folder's config and
weight files, each file's SHA-256 kept in the run's ``cache_dir`` under its resolved path, size and
mtime, so that a second run reads no weights to record them and a changed file is hashed again."""

import hashlib
import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from recipes.resume_record import DIGESTS, frozen_record
from recipes.tiny_models import tiny_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama folder as transformers saves it: config.json, model.safetensors."""
    made = tmp_path_factory.mktemp("frozen") / "llama"
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64)).save_pretrained(made)
    return made


def weights_of(folder: Path) -> str:
    """The record's ``weights`` computed here from the files' bytes: what runs before the cache
    recorded, so their checkpoints still match."""
    kept = [
        path
        for path in folder.iterdir()
        if path.name == "config.json" or path.suffix == ".safetensors"
    ]
    names = sorted(path.name for path in kept)
    files = [(name, hashlib.sha256((folder / name).read_bytes()).hexdigest()) for name in names]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def test_a_second_record_reads_the_cached_digests_and_a_changed_file_is_hashed_again(
    folder, tmp_path
):
    cache = tmp_path / "cache"
    first = frozen_record("the teacher", folder, None, cache)
    assert first == {"from": "the teacher", "weights": weights_of(folder)}
    entries = {
        json.loads(path.read_text())["file"][0]: path for path in (cache / DIGESTS).iterdir()
    }
    weights = folder / "model.safetensors"
    assert set(entries) == {str(weights.resolve()), str((folder / "config.json").resolve())}
    # the kept digest is what the second record reads: another one there changes the record
    kept = json.loads(entries[str(weights.resolve())].read_text())
    true_digest = kept["sha256"]
    entries[str(weights.resolve())].write_text(json.dumps({**kept, "sha256": "0" * 64}))
    assert frozen_record("the teacher", folder, None, cache)["weights"] != first["weights"]
    entries[str(weights.resolve())].write_text(json.dumps({**kept, "sha256": true_digest}))
    assert frozen_record("the teacher", folder, None, cache) == first
    # new bytes of the same size, a later mtime: hashed again, the record the new bytes'
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    mtime = weights.stat().st_mtime_ns
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(mtime + 10**9, mtime + 10**9))
    changed = frozen_record("the teacher", folder, None, cache)
    assert changed["weights"] == weights_of(folder) != first["weights"]
    assert len(list((cache / DIGESTS).iterdir())) == 3  # the old file's entry, and the new one's


def test_a_built_model_is_recorded_by_its_settings_without_the_cache(tmp_path):
    built = {"family": "llama", "config": {"hidden_size": 64}}
    record = frozen_record("built", None, built, tmp_path / "cache")
    expected = hashlib.sha256(json.dumps(built, sort_keys=True).encode()).hexdigest()[:16]
    assert record == {"from": "built", "weights": expected} and not (tmp_path / "cache").exists()
