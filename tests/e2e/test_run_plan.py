"""The run plan through the real command line: the value checked is the value used (``~`` paths),
and under torchrun on an empty cache one process (rank 0, preparing the plan) reads the data file
and tokenizes it while the other ranks wait for its plan.

Both tests run in ``make test`` (no ``sweep`` cases), in one module-wide ``HOME`` whose site folder
counts the data file's opens: one warm interpreter (tests/cli.py) serves both, and torchrun's
agent and rendezvous are real while its workers start warm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
        if str(file) == os.environ.get("COUNT_PATH"):
            with _open(os.environ["COUNT_LOG"], "a") as log:
                log.write(f"{os.getpid()}\\n")
        return opener(file, *args, **kwargs)
    return open_
builtins.open = _counting(_open)
io.open = _counting(_io_open)
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The ``HOME`` of every run here, with COUNTER's site folder: one import-time environment."""
    home = tmp_path_factory.mktemp("home")
    (home / "site").mkdir()
    (home / "site" / "sitecustomize.py").write_text(COUNTER)
    return home


def environment_in(home: Path, **counting: str) -> dict[str, str]:
    """A run's environment: ``home`` as HOME (so the default cache is under it), COUNTER imported,
    ``counting`` (COUNT_PATH, COUNT_LOG) its late-read settings."""
    path = os.pathsep.join([str(home / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    environment = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    environment.pop("SHARDTUNE_CACHE", None)
    return environment | counting


def run(arguments: list[str], environment: dict[str, str], torchrun: bool = False):
    """``python recipes/finetune.py`` warm; or ``torchrun --nproc_per_node=2`` of it, whose agent
    is a fresh interpreter (a warm one would need a zygote of its own: its environment names its
    workers' python) and whose workers start warm (:func:`tests.cli.warm_torchrun_environment`)."""
    command = [sys.executable, "recipes/finetune.py", *SMALL, *arguments]
    start = cli.run
    if torchrun:
        command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node=2"]
        environment, start = cli.warm_torchrun_environment(environment), subprocess.run
    result = start(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-3000:]}"
    return result


def test_tilde_paths_for_data_output_and_resume(home):
    (home / "chat.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    # Hydra's override grammar needs ~ quoted: data.path='~/chat.jsonl' (in a shell:
    # "data.path='~/chat.jsonl'").
    data, environment = ["data=jsonl", "data.path='~/chat.jsonl'"], environment_in(home)
    first = run(
        [*data, "train.max_steps=2", "checkpoint.every_steps=2", "output_dir='~/first'"],
        environment,
    )
    assert (home / "first" / "checkpoints" / "step_00000002").is_dir()
    # the README's "your own data" line: the default model is random, and the run says so
    (note,) = [line for line in first.stdout.splitlines() if "random weights" in line]
    assert note.startswith("note: model=llama is built from its config with random weights")
    assert "model=smollm2" in note
    resume = "checkpoint.resume='~/first/checkpoints/step_00000002'"
    result = run([*data, "train.max_steps=3", resume, "output_dir='~/second'"], environment)
    assert f"resumed from {home}/first/checkpoints/step_00000002 at step 2" in result.stdout
    steps = [
        json.loads(line)["step"]
        for line in (home / "second" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [3]
    saved = (home / "second" / "config.yaml").read_text()
    assert "path: ~/chat.jsonl" in saved and "max_steps: 3" in saved


def test_under_torchrun_one_process_reads_the_data_and_tokenizes_it(home, tmp_path):
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    log = tmp_path / "opens.log"
    arguments = [
        "tp=2",
        "data=jsonl",
        f"data.path={data_file}",
        "train.max_steps=1",
        f"output_dir={tmp_path / 'out'}",
        f"cache_dir={tmp_path / 'cache'}",  # empty (HOME's holds the tilde test's tokenized copy)
    ]
    counting = environment_in(home, COUNT_PATH=str(data_file), COUNT_LOG=str(log))
    result = run(arguments, counting, torchrun=True)
    opens_per_process = {}
    for pid in log.read_text().split():
        opens_per_process[pid] = opens_per_process.get(pid, 0) + 1
    # One process hashes its bytes once (the cache key: content, not size and mtime), then reads
    # it once into its Arrow copy (the tokenizer's texts and the tokenization read that copy).
    assert len(opens_per_process) == 1, opens_per_process
    assert list(opens_per_process.values()) == [2], opens_per_process
    written = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert len(written) == 1 and "written to the cache" in written[0], result.stdout
