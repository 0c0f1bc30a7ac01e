"""A newcomer's first hour, through the real command line: what they type first just works.

Each test runs ``python recipes/finetune.py`` as a user would (tiny model, few steps) and checks
what the README promises: a warmup longer than the run is cut with a ``note:``, ``output_dir`` is
where a run writes, ``--help`` and ``--cfg job`` load no model or data library, the default output
folder is one per run, and the ``data:`` line says whether tokenized data was reused or written.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests import cli

REPO = Path(__file__).resolve().parents[2]
QUICK = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.val_every=0"]
QUICK += ["checkpoint.export=false", "data.num_examples=100"]


def recipe(*arguments: str, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "recipes/finetune.py"), *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return cli.run(
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
    result = cli.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [
        line.split("|") for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    return result, {parts[-1].strip() for parts in lines if len(parts) == 3}


def test_help_and_the_composed_config_import_no_torch_model_data_or_tokenizer_code():
    heavy = ("torch", "transformers", "datasets", "tokenizers")  # the command line is Hydra's
    heavy += ("components.models", "components.data")
    # nor what only ranks run: DTensor (and the sympy it loads), DCP, FSDP, the loss plot
    heavy += ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp")
    heavy += ("sympy", "matplotlib", "components.checkpoint", "components.distributed")
    light = {"components.models", "components.models.options"}  # the schema's choices: no import
    for arguments in (["--help"], ["--cfg", "job"], ["--cfg", "job", "model=qwen3", "tp=2"]):
        result, modules = imported_modules(*arguments)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "hydra" in modules  # the measurement works: the command line imports Hydra
        loaded = sorted(m for m in modules if m.split(".")[0] in heavy or m.startswith(heavy))
        loaded = [module for module in loaded if module not in light]
        assert not loaded, f"{' '.join(arguments)} imported {loaded[:10]}"
        if arguments == ["--help"]:  # the recipe's page, not Hydra's: groups and common keys
            help_lines = result.stdout.splitlines()
    assert help_lines[0].startswith("shardtune") and "Hydra" not in help_lines[0]
    assert "  model=      llama*, mixtral, pretrained, qwen3, qwen3_moe, smollm2" in help_lines
    assert any(line.split()[:3] == ["tp", "tensor-parallel", "size"] for line in help_lines)
    assert any(line.split()[:1] == ["train.max_steps"] for line in help_lines)


def test_the_composed_config_refuses_a_misspelt_key_as_a_run_does_not_with_a_plus():
    """``--cfg job trian.max_steps=3``: the recipe's one error line and the key it resembles, not
    Hydra's "To append to your config use +trian.max_steps=3", which a run then refuses."""
    printed = recipe("--cfg", "job", "trian.max_steps=3")
    run = recipe("trian.max_steps=3")
    assert printed.returncode == run.returncode == 2, printed.stderr[-3000:]
    (line,) = printed.stderr.splitlines()
    assert line == run.stderr.strip()  # the same line as the run's
    assert line.endswith("did you mean train.max_steps?") and "To append" not in line


def test_a_mistyped_key_or_a_bad_value_is_refused_without_model_data_or_rank_code():
    # transformers' config classes judge model.config; nothing heavier runs before the error line
    heavy = ("datasets", "tokenizers", "components.data", "components.models.build")
    heavy += ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp")
    heavy += ("sympy", "matplotlib", "components.checkpoint", "components.planning")
    for argument, key in (("trian.max_steps=3", "trian"), ("train.max_steps=-1", "max_steps")):
        result, modules = imported_modules(argument)
        assert result.returncode == 2, result.stderr[-3000:]
        [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert key in line
        loaded = sorted(m for m in modules if m.split(".")[0] in heavy or m.startswith(heavy))
        assert not loaded, f"{argument} imported {loaded[:10]}"


def test_the_readme_packing_example_runs_and_a_longer_seq_len_names_the_key(tmp_path):
    packed = tmp_path / "packed"
    example = ["train.packing=true", "train.seq_len=512"]  # as README.md writes it
    result = recipe(*example, "train.max_steps=2", *QUICK, f"output_dir={packed}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps(packed) == [1, 2]
    result = recipe("train.seq_len=1024", f"output_dir={tmp_path / 'long'}")
    assert result.returncode == 2
    assert "model.config.max_position_embeddings=512" in result.stderr


def test_a_data_line_says_whether_tokenized_data_was_written_or_reused(tmp_path):
    cache = ["cache_dir=" + str(tmp_path / "cache"), "train.max_steps=1", *QUICK]
    lines = []
    for run in ("first", "second"):
        result = recipe(*cache, f"output_dir={tmp_path / run}")
        assert result.returncode == 0, result.stderr[-3000:]
        lines.append([line for line in result.stdout.splitlines() if line.startswith("data:")])
    (written,), (reused,) = lines
    assert written.startswith(f"data: tokenized data written to the cache: {tmp_path / 'cache'}")
    folder = written.split(": ")[2].split(" (")[0]
    assert reused.startswith(f"data: tokenized data reused from the cache: {folder} (")
    assert Path(folder, "meta.json").is_file()


def test_output_dir_is_where_a_run_writes_and_another_hydra_run_dir_is_one_error(tmp_path):
    ours, hydras = tmp_path / "A", tmp_path / "B"
    result = recipe("train.max_steps=1", *QUICK, f"output_dir={ours}", f"hydra.run.dir={hydras}")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: hydra.run.dir='{hydras}' and output_dir='{ours}' disagree")
    assert not ours.exists() and not hydras.exists()
    hydra_entry = ["-cn", "config"]  # a flag: Hydra's own entry point (it makes the run dir)
    result = recipe(
        *hydra_entry, "train.max_steps=1", *QUICK, f"output_dir={ours}", f"hydra.run.dir={hydras}"
    )
    assert result.returncode == 2 and "disagree: a run writes to output_dir" in result.stderr
    result = recipe("train.max_steps=1", *QUICK, f"output_dir={ours}", f"hydra.run.dir={ours}")
    assert result.returncode == 0, result.stderr[-3000:]  # the same folder twice is no disagreement
    assert steps(ours) == [1]


def test_the_default_output_dir_is_a_new_folder_per_run_so_a_second_run_is_not_refused(tmp_path):
    for _ in range(2):  # `make run` twice in a row, from a folder of its own (outputs/ is relative)
        result = recipe("train.max_steps=1", *QUICK, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted((tmp_path / "outputs" / "llama").iterdir())
    assert len(runs) == 2 and all(steps(run) == [1] for run in runs)
    # DATE_TIME, and DATE_TIME_2 for a run that started in the same second as the one before
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(_2)?", run.name) for run in runs)
    result = recipe("train.max_steps=1", *QUICK, "checkpoint.resume=auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: checkpoint.resume=auto finds nothing in" in result.stdout


def test_torchrun_needs_an_explicit_output_dir(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    command = [*torchrun, str(REPO / "recipes/finetune.py"), "train.max_steps=1", *QUICK]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment = cli.warm_torchrun_environment(environment)  # its worker starts warm
    result = cli.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode != 0
    assert "error: output_dir must be given under torchrun" in result.stderr
    assert not (tmp_path / "outputs").exists()
