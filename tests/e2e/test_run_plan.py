"""The run plan through the real command line: the value checked is the value used (``~`` paths),
and under torchrun on an empty cache one process (rank 0, preparing the plan) reads the data file
and tokenizes it while the other ranks wait for its plan."""

import json
import os
import sys
from pathlib import Path

from tests import cli

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.val_every=0",
    "checkpoint.export=false",
]
SMALL += ["train.warmup_steps=1"]
RECORDS = [
    {"prompt": f"say {word}", "response": f"{word} {word}"}
    for word in ("a", "bb", "ccc", "dd", "e")
] * 8

# Imported by every Python process started with this folder on PYTHONPATH: counts each open() of the
# data file.
COUNTER = """
import builtins, io, os
_open, _io_open = builtins.open, io.open
def _counting(opener):
    def open_(file, *args, **kwargs):
        if str(file) == os.environ["COUNT_PATH"]:
            with _open(os.environ["COUNT_LOG"], "a") as log:
                log.write(f"{os.getpid()}\\n")
        return opener(file, *args, **kwargs)
    return open_
builtins.open = _counting(_open)
io.open = _counting(_io_open)
"""


def run(
    arguments: list[str],
    home: Path,
    extra_env: dict | None = None,
    launcher: list[str] | None = None,
):
    environment = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    environment.pop("SHARDTUNE_CACHE", None)
    command = [*(launcher or [sys.executable]), "recipes/finetune.py", *SMALL, *arguments]
    result = cli.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-3000:]}"
    return result


def test_tilde_paths_for_data_output_and_resume(tmp_path):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    # Hydra's override grammar needs ~ quoted: data.path='~/chat.jsonl' (in a shell:
    # "data.path='~/chat.jsonl'").
    data = ["data=jsonl", "data.path='~/chat.jsonl'"]
    first = run(
        [*data, "train.max_steps=2", "checkpoint.every_steps=2", "output_dir='~/first'"], tmp_path
    )
    assert (tmp_path / "first" / "checkpoints" / "step_00000002").is_dir()
    # the README's "your own data" line: the default model is random, and the run says so
    (note,) = [line for line in first.stdout.splitlines() if "random weights" in line]
    assert note.startswith("note: model=llama is built from its config with random weights")
    assert "model=smollm2" in note
    resume = "checkpoint.resume='~/first/checkpoints/step_00000002'"
    result = run([*data, "train.max_steps=3", resume, "output_dir='~/second'"], tmp_path)
    assert f"resumed from {tmp_path}/first/checkpoints/step_00000002 at step 2" in result.stdout
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [3]
    saved = (tmp_path / "second" / "config.yaml").read_text()
    assert "path: ~/chat.jsonl" in saved and "max_steps: 3" in saved


def test_under_torchrun_one_process_reads_the_data_and_tokenizes_it(tmp_path):
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTER)
    log = tmp_path / "opens.log"
    env = {
        "PYTHONPATH": str(tmp_path / "site"),
        "COUNT_PATH": str(data_file),
        "COUNT_LOG": str(log),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    arguments = [
        "tp=2",
        "data=jsonl",
        f"data.path={data_file}",
        "train.max_steps=1",
        f"output_dir={tmp_path / 'out'}",
    ]
    result = run(arguments, tmp_path, env, torchrun)
    opens_per_process = {}
    for pid in log.read_text().split():
        opens_per_process[pid] = opens_per_process.get(pid, 0) + 1
    # One process hashes its bytes once (the cache key: content, not size and mtime), then reads
    # it once into its Arrow copy (the tokenizer's texts and the tokenization read that copy).
    assert len(opens_per_process) == 1, opens_per_process
    assert list(opens_per_process.values()) == [2], opens_per_process
    written = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert len(written) == 1 and "written to the cache" in written[0], result.stdout
