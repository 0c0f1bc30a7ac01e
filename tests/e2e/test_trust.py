"""Runs you can trust, through the real command line: a run owns its folder, never adopts or
overwrites another run's files, runs no code from a checkpoint, says what it does with a damaged
one, and refuses a resume that cannot continue the same training.

By default a run inside another's hf/ folder, and a stop with checkpointing off (its last step
saved by the stop alone); the runs inside checkpoints/ and hf/ themselves (the same refusal) and the
stop beside checkpoints every 4 steps run under ``-m sweep``."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cli
from tests.harness import tiny_model_folder

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.val_every=0",
    "train.warmup_steps=1",
]
SMALL += ["data.num_examples=200"]
SWEEP = pytest.mark.sweep


def command(output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "recipes/finetune.py", *SMALL, f"output_dir={output_dir}", *overrides]


def run(output_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(
        command(output_dir, *overrides),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout[-2000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")][-1]


def steps(output_dir: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4 (never changed by the tests: they copy
    it)."""
    folder = tmp_path_factory.mktemp("trained") / "run"
    result = run(folder, "train.max_steps=4", "checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def copy_of(trained: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(trained, folder, ignore=shutil.ignore_patterns(".lock"))
    return folder


def test_a_fresh_run_never_adopts_another_runs_files(trained, tmp_path):
    folder = copy_of(trained, tmp_path)
    line = error_line(run(folder, "train.max_steps=6"))
    assert "holds another run's files" in line and "checkpoint.resume=auto" in line
    assert "overwrite_output_dir=true" in line and "another output_dir" in line
    assert steps(folder) == [1, 2, 3, 4] and (folder / "checkpoints" / "step_00000004").is_dir()

    (folder / "notes.txt").write_text("the user's own file\n")
    result = run(folder, "train.max_steps=2", "overwrite_output_dir=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps(folder) == [1, 2] and not (folder / "checkpoints").exists()
    assert (folder / "notes.txt").read_text() == "the user's own file\n"


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_holder(tmp_path):
    folder = tmp_path / "busy"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the holder stops itself (SIGSTOP) at step 2: alive and holding the folder, it spends no CPU
    # while the second run is refused
    first = cli.Popen(
        command(folder, "train.max_steps=100000", "debug.fault=stop@2"),
        cwd=REPO,
        env=environment,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (folder / "metrics.jsonl").is_file():
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first run did not start training"
            )
            time.sleep(0.2)
        line = error_line(run(folder, "train.max_steps=2", "overwrite_output_dir=true"))
        assert "is in use by another run" in line and f"pid {first.pid}" in line, line
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_runs_no_code(trained, tmp_path):
    folder = copy_of(trained, tmp_path)
    marker = tmp_path / "payload_ran"
    metadata = folder / "checkpoints" / "step_00000004" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    line = error_line(run(folder, "train.max_steps=6", f"checkpoint.resume={metadata.parent}"))
    assert "step_00000004" in line and ".metadata" in line, line
    assert not marker.exists()


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_out_loud(trained, tmp_path):
    folder = copy_of(trained, tmp_path)
    shard = next((folder / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    result = run(folder, "train.max_steps=6", "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"warning: skipping checkpoint {folder / 'checkpoints' / 'step_00000004'}" in result.stdout
    )
    assert "is truncated" in result.stdout
    assert f"resumed from {folder / 'checkpoints' / 'step_00000002'} at step 2" in result.stdout
    assert steps(folder) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["train.max_steps=6", "train.global_batch_size=8"],
            "global_batch_size is 8 but the checkpoint was written with 4",
        ),
        (
            ["train.max_steps=6", "optim=sgd"],
            "optimizer is 'torch.optim.SGD' but the checkpoint was written with "
            "'torch.optim.AdamW'",
        ),
        (["train.max_steps=6", "model.config.intermediate_size=96"], "model is"),
        (["train.max_steps=3"], "max_steps 3 is not beyond the checkpoint's step 4"),
        # more records train another tokenizer of the same size: the same ids would mean other
        # tokens
        (["train.max_steps=6", "data.num_examples=300"], "tokenizer is"),
    ],
    ids=["batch geometry", "optimizer", "model", "max_steps", "tokenizer"],
)
def test_a_resume_that_cannot_continue_the_same_training_is_refused(
    trained, tmp_path, overrides, expected
):
    folder = copy_of(trained, tmp_path)
    line = error_line(run(folder, "checkpoint.resume=auto", *overrides))
    assert (
        f"cannot resume from {folder / 'checkpoints' / 'step_00000004'}" in line
        and expected in line
    ), line


def test_a_checkpoint_of_another_run_never_continues_inside_a_third_runs_folder(trained, tmp_path):
    other = tmp_path / "other"
    assert run(other, "train.max_steps=2", "optim.lr=1e-2").returncode == 0
    before = (other / "metrics.jsonl").read_text()
    checkpoint = f"checkpoint.resume={trained / 'checkpoints' / 'step_00000002'}"
    line = error_line(run(other, checkpoint, "train.max_steps=6"))
    assert "holds another run's files than the one checkpoint.resume" in line, line
    assert (other / "metrics.jsonl").read_text() == before  # the folder's own run is untouched
    replaced = run(other, checkpoint, "train.max_steps=3", "overwrite_output_dir=true")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert steps(other) == [3]  # the folder now holds the resumed run alone


def test_replicas_that_drift_without_checks_stop_the_run_before_export(tmp_path):
    result = run(tmp_path / "drift", "tp=2", "train.max_steps=3", "debug.fault=perturb_replica@2")
    line = error_line(result)
    assert "replicated tensors differ at the end of the run" in line and "not exported" in line, (
        line
    )
    assert not (tmp_path / "drift" / "hf").exists()


CUSTOM_CODE = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def model_folder_with_code(root: Path, where: str) -> Path:
    """A tiny Llama folder whose ``where`` file points at a ``custom.py`` beside it that, once
    imported, writes ``root/marker``."""
    folder = tiny_model_folder(root)
    (folder / "custom.py").write_text(CUSTOM_CODE.format(marker=str(root / "marker")))
    path = folder / where
    content = json.loads(path.read_text())
    if where == "config.json":  # a model type transformers does not know, built by its own code
        content.update(model_type="custom_llm", auto_map={"AutoConfig": "custom.Config"})
        content["auto_map"]["AutoModelForCausalLM"] = "custom.Model"
    else:
        content["auto_map"] = {"AutoTokenizer": ["custom.Tokenizer", None]}
    path.write_text(json.dumps(content))
    return folder


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_code_in_a_model_folder_never_runs_and_nothing_asks(tmp_path, where):
    folder = model_folder_with_code(tmp_path, where)
    output = tmp_path / "out"
    result = cli.run(
        command(output, "train.max_steps=2", "model=pretrained", f"model.pretrained_path={folder}"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        input="y\n",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = error_line(result)
    assert result.stderr.strip().splitlines() == [line], result.stderr
    assert f"{folder / where} has an auto_map (custom." in line and "never" in line, line
    if where == "config.json":
        assert "model_type='custom_llm', which transformers does not know" in line, line
    assert "[y/N]" not in result.stdout + result.stderr
    assert not (tmp_path / "marker").exists()
    assert not output.exists() or not any(output.iterdir())


def test_a_resume_from_an_earlier_step_never_returns_to_the_branch_it_left(tmp_path):
    folder = tmp_path / "branches"
    assert run(folder, "train.max_steps=6", "checkpoint.every_steps=2").returncode == 0
    old_six = json.loads((folder / "metrics.jsonl").read_text().splitlines()[5])
    earlier = folder / "checkpoints" / "step_00000004"
    # the new branch from step 4 crashes at the start of step 6, before its own checkpoint of step 6
    every = "checkpoint.every_steps=2"
    fault = "debug.fault=raise@6"
    branch = run(folder, "train.max_steps=10", every, f"checkpoint.resume={earlier}", fault)
    assert branch.returncode != 0
    note = "note: resuming from step 4: the later checkpoints of the branch it leaves are moved"
    assert f"{note} aside (step_00000006.abandoned)" in branch.stdout, branch.stdout[-3000:]
    kept = sorted(path.name for path in (folder / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006.abandoned"]  # keep=2 had pruned step 2
    again = run(folder, "train.max_steps=10", every, "checkpoint.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {earlier} at step 4" in again.stdout, again.stdout[-3000:]
    assert steps(folder) == list(range(1, 11))  # one timeline: steps 5 and 6 of the new branch
    new_six = json.loads((folder / "metrics.jsonl").read_text().splitlines()[5])
    assert new_six["step"] == old_six["step"] == 6
    assert new_six["lr"] != old_six["lr"]  # the step of the 10-step schedule, not of the 6-step one


def test_overwrite_never_removes_files_no_run_recorded(tmp_path):
    """A user's own files that share shardtune's names, in a folder that never held a run (no
    run.json), and a copy of the project's conf/ (output_dir=conf once replaced its config.yaml)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in (("config.yaml", "my: config\n"), ("metrics.jsonl", '{"mine": 1}\n')):
        (mine / name).write_text(text)
    (mine / "loss.png").write_bytes(b"my plot")
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    for folder in (mine, conf):
        before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
        for overwrite in ("overwrite_output_dir=true", "overwrite_output_dir=false"):
            line = error_line(run(folder, "train.max_steps=2", overwrite))
            assert f"output_dir {folder} holds" in line and "but no readable run.json" in line, line
            assert "may be your own files" in line, line
            assert "not even with overwrite_output_dir=true" in line, line
            after = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
            assert after == before  # nothing replaced, removed or added (no run.json, no .lock)


@pytest.mark.parametrize(
    "inside",
    [pytest.param("checkpoints/mine", marks=SWEEP), pytest.param("hf", marks=SWEEP), "hf/mine"],
)
def test_a_run_inside_another_runs_folder_is_refused(trained, inside):
    before = sorted(str(path) for path in trained.rglob("*"))
    line = error_line(run(trained / inside, "train.max_steps=2"))
    assert line == (
        f"error: output_dir {trained / inside} is inside the output folder of another run "
        f"({trained}, with its run.json), whose pruning or overwrite would delete it: nested "
        "output "
        f"folders are not allowed; choose an output_dir outside {trained}"
    )
    assert sorted(str(path) for path in trained.rglob("*")) == before  # nothing written there


def test_a_folder_holding_another_runs_folder_below_it_is_refused(trained, tmp_path):
    outer = tmp_path / "outer"
    shutil.copytree(
        trained, outer / "checkpoints" / "inner", ignore=shutil.ignore_patterns(".lock")
    )
    line = error_line(run(outer, "train.max_steps=2"))
    below = f"output_dir {outer} holds the output folder of another run below it"
    assert f"{below} ({outer / 'checkpoints' / 'inner'}," in line, line
    assert "nested output folders are not allowed" in line, line
    assert not (outer / "run.json").exists()


@pytest.mark.parametrize(
    "every", [pytest.param(4, marks=SWEEP), 0], ids=["every 4 steps", "checkpointing off"]
)
def test_stop_after_leaves_a_checkpoint_of_its_last_step_and_says_only_what_exists(tmp_path, every):
    folder = tmp_path / "stopped"
    saving = f"checkpoint.every_steps={every}"
    first = run(folder, "train.max_steps=10", saving, "train.stop_after=6")
    assert first.returncode == 0, first.stderr[-3000:]
    done = [line for line in first.stdout.splitlines() if line.startswith("done: ")]
    assert done == [
        f"done: metrics, loss.png and checkpoint step_00000006 in {folder} (no hf/ before step "
        "10); "
        "checkpoint.resume=auto continues from it"
    ]
    assert not (folder / "hf").exists() and steps(folder) == [1, 2, 3, 4, 5, 6]
    kept = sorted(path.name for path in (folder / "checkpoints").iterdir())
    assert kept == (["step_00000004", "step_00000006"] if every else ["step_00000006"])
    second = run(folder, "train.max_steps=10", saving, "checkpoint.resume=auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {folder / 'checkpoints' / 'step_00000006'} at step 6" in second.stdout
    assert f"done: metrics, loss.png and hf/ in {folder}" in second.stdout
    assert steps(folder) == list(range(1, 11))  # one line a step: nothing done twice
