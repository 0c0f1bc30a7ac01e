"""model.pretrained_path as a Hub id: found in a Hugging Face cache built here (the Hub's own
layout), loaded; an id that is not cached while offline is one error line. Nothing here reaches the
network."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from components.models import build_causal_lm, load_config
from components.models.hub import ModelSourceError, looks_like_hub_id, resolve_model_folder
from recipes.tiny_models import tiny_config

REPO = Path(__file__).resolve().parents[3]
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def hub_cache(root: Path, repo_id: str, model) -> Path:
    """A Hugging Face hub cache holding ``repo_id`` at revision main, as ``hf download`` leaves
    it."""
    owner, name = repo_id.split("/")
    repo = root / f"models--{owner}--{name}"
    model.save_pretrained(repo / "snapshots" / SHA)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    return root


def test_a_cached_hub_id_resolves_to_its_snapshot_and_loads(tmp_path):
    model = build_causal_lm(tiny_config("llama", num_hidden_layers=1), seed=7)
    cache = hub_cache(tmp_path / "hub", "owner/tiny-llama", model)
    folder = resolve_model_folder("owner/tiny-llama", allow_download=False, cache_dir=cache)
    assert folder == cache / "models--owner--tiny-llama" / "snapshots" / SHA
    assert load_config(folder).hidden_size == model.config.hidden_size
    tokens = torch.arange(10).view(1, 10)
    with torch.no_grad():
        assert torch.equal(
            AutoModelForCausalLM.from_pretrained(folder)(tokens).logits, model(tokens).logits
        )


def test_an_uncached_hub_id_offline_is_one_error_line(tmp_path):
    with pytest.raises(ModelSourceError) as caught:
        resolve_model_folder("owner/missing", allow_download=False, cache_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith(
        "model.pretrained_path='owner/missing' is not a local folder and is not in the Hugging "
        "Face cache (offline): "
    )
    assert str(tmp_path) in message and "\n" not in message


def test_local_folders_win_and_other_text_is_refused(tmp_path, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    (tmp_path / "owner" / "name" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_folder("owner/name", allow_download=False) == Path("owner/name")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_folder("~/owner/name", allow_download=False) == tmp_path / "owner" / "name"
    with pytest.raises(
        ModelSourceError, match=r"is neither a local folder nor a Hugging Face Hub id"
    ):
        resolve_model_folder("no/such/folder", allow_download=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=r"no config.json"):
        resolve_model_folder("empty", allow_download=False)
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not any(map(looks_like_hub_id, ["gpt2", "a/b/c", "../x", "/abs/path", "owner/.."]))


def test_hf_hub_cache_and_offline_come_from_the_environment(tmp_path):
    """As a user runs it: HF_HUB_CACHE names the cache, HF_HUB_OFFLINE=1 forbids the network."""
    cache = hub_cache(
        tmp_path / "hub",
        "owner/tiny",
        build_causal_lm(tiny_config("llama", num_hidden_layers=1), seed=0),
    )
    # hub.py loaded by path: the components.models package would import torch and transformers
    # (seconds).
    script = (
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('hub', 'components/models/hub.py')\n"
        "hub = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(hub)\n"
        "print(hub.resolve_model_folder('owner/tiny'))\n"
        "try:\n    hub.resolve_model_folder('owner/absent')\nexcept hub.ModelSourceError as "
        "error:\n    print(error)\n"
    )
    environment = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    resolved, error = result.stdout.splitlines()
    assert resolved == str(cache / "models--owner--tiny" / "snapshots" / SHA)
    assert error.startswith(
        "model.pretrained_path='owner/absent' is not a local folder and is not in the Hugging"
    )


def test_a_peft_adapter_folder_is_named_as_one_with_the_folder_that_works(tmp_path):
    """A ``peft=lora`` run's ``adapter/`` given as a model (a teacher, a policy): the line says it
    holds an adapter, not that the user's folder is broken, and names the merged export."""
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelSourceError) as refused:
        resolve_model_folder(str(tmp_path / "adapter"), allow_download=False, key="teacher.path")
    assert str(refused.value) == (
        f"teacher.path={str(tmp_path / 'adapter')!r}: the folder {tmp_path / 'adapter'} holds a "
        "PEFT adapter (adapter_config.json), not a whole model: give the folder of a whole model, "
        "e.g. the hf/ of a run exported with peft.merge=true (the base with the adapter merged in)"
    )
