"""A newcomer's first hour, through the real command line: what they type first just works.

Each test runs ``python recipes/finetune.py`` as a user would (tiny model, few steps) and checks
what the README promises: a warmup longer than the run is cut with a ``note:``, ``output_dir`` is
where a run writes, ``--help`` and ``--cfg job`` load no model or data library, the default output
folder is one per run, and the ``data:`` line says whether tokenized data was reused or written.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICK = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.val_every=0"]
QUICK += ["checkpoint.export=false", "data.num_examples=100"]


def recipe(*arguments: str, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "recipes/finetune.py"), *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=300, env=environment, **kwargs
    )


def steps(output_dir: Path) -> list[int]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_one_note(tmp_path):
    result = recipe(
        "train.max_steps=3", *QUICK, f"output_dir={tmp_path}"
    )  # the default warmup is 5
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: train.warmup_steps=5 is cut to the run's 3 steps"]
    assert "error" not in result.stderr
    assert steps(tmp_path) == [1, 2, 3]


def imported_modules(*arguments: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command's result and every module it imported (``python -X importtime`` lists them)."""
    command = [sys.executable, "-X", "importtime", "recipes/finetune.py", *arguments]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [
        line.split("|") for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    return result, {parts[-1].strip() for parts in lines if len(parts) == 3}


def test_help_and_the_composed_config_import_no_model_data_or_tokenizer_code():
    heavy = ("transformers", "datasets", "tokenizers", "components.models", "components.data")
    for arguments in (["--help"], ["--cfg", "job"], ["--cfg", "job", "model=qwen3", "tp=2"]):
        result, modules = imported_modules(*arguments)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "torch" in modules  # the measurement works: the recipe itself imports torch
        loaded = sorted(m for m in modules if m.split(".")[0] in heavy or m.startswith(heavy))
        assert not loaded, f"{' '.join(arguments)} imported {loaded[:10]}"
    assert "shardtune" in imported_modules("--help")[0].stdout
