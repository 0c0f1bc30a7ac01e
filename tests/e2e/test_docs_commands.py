"""Every command line of README.md and docs/*.md runs as written in a fresh clone after `make run`.

The command lines are those of the pages' shell code blocks (``tests/unit/test_docs.py`` reads them
the same way; continuations joined). They run in one folder standing for a clone (the repository's
``recipes``, ``conf``, ``examples`` and ``Makefile`` linked in, ``.venv`` linked to this
interpreter's environment), one page after another, README first, each page top to bottom, so a
line that reuses an earlier line's folder meets what that line left there. The clone starts as
``make run`` leaves one: a finished run under ``outputs/llama/``. Every line runs at a tiny size
and with one cache (``$SHARDTUNE_CACHE``):

- a recipe line (``.venv/bin/python recipes/finetune.py``, ``.venv/bin/torchrun ...
  recipes/finetune.py``) gets ``train.max_steps`` (2, or one past the step a ``debug.fault`` or
  ``profile.steps`` names) unless it sets it or is a dry run, through the warm interpreter of
  ``tests/cli.py``; it must exit 0, or fail as :data:`EXPECTED_FAILURES` says (fault drills);
- ``make TARGET``: ``make -n`` (what it would run) must succeed; ``make help`` runs, and
  ``make run``'s recipe command runs as above;
- ``.venv/bin/python -c ...`` runs; ``.venv/bin/python -m pytest ...`` is collected only;
- :data:`NOT_RUN` lists the lines that cannot run here, each with the reason (a download from the
  Hub, Slurm, the GPU lane's own command) and the test that covers it where one does;
  :data:`MARKED` those that need what an opt-in marker's machine has (a GPU: ``cuda``; SmolLM2
  from the package index: ``smollm2``), run by that marker's test.

A bare ``python`` or ``torchrun`` fails: outside the venv it is not the project's interpreter.
The user's own files a page names (``my.jsonl``, ``my_folder``, ``/path/to/hf_model``) are made
here (:func:`users_files`).

Every page's lines run under the opt-in marker ``docs`` (``pytest -m docs``: 84 of 96 lines, 7-9
minutes on 2 cores, too long for ``make test``; 7 more under ``cuda`` and ``smollm2``). ``make
test`` checks that every line is one the runner knows, written with the venv's programs (every
make target through ``make -n``), and runs :data:`REPRESENTATIVE` after ``make run`` (35 s
measured, the warm interpreter's start included).
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import cli
from tests.unit.test_docs import _split

REPO = Path(__file__).resolve().parents[2]
HISTORY = REPO / "docs" / "benchmarks-history.md"
# Not the dated benchmark history: it records the commands of past runs.
PAGES = [REPO / "README.md", *sorted(set((REPO / "docs").glob("*.md")) - {HISTORY})]
VENV = Path(sys.prefix)
LINKED = (
    "recipes",
    "conf",
    "examples",
    "components",
    "tests",
    "Makefile",
    "pyproject.toml",
    "constraints.txt",
)
RECIPE = "recipes/finetune.py"
RECIPES = (RECIPE, "recipes/dpo.py", "recipes/distill.py")  # a line may run any
TINY_STEPS = 2
TIMEOUT_S = 600
# Lines that cannot run here, by a text they hold: why, and the test that covers them.
NOT_RUN = {
    "model.pretrained_path=HuggingFaceTB/": "downloads from the Hugging Face Hub",
    "sbatch ": "needs Slurm",
    "-m cuda": "the GPU lane itself (bench/gpu_check.sh runs it)",
}
# Lines that run only where an opt-in marker's tests run, by a text they hold: the marker, and why.
MARKED = {
    "model=smollm2": ("smollm2", "downloads SmolLM2 from the package index"),
    "profile.memory=true": ("cuda", "a CUDA memory snapshot (tests/cuda/test_profiler.py)"),
    "model.attn_implementation=flash_attention": ("cuda", "needs a GPU and the flash-attn package"),
}
# Lines that fail on purpose (fault drills), by a text they hold: their status and what they say.
EXPECTED_FAILURES = {
    "debug.fault=nan_grad@3": (1, "step 3: grad norm is nan"),
    "debug.fault=stop@4": (1, "made no progress"),
}
# The user's files the pages name, made by users_files.
PLACEHOLDERS = {"/path/to/hf_model": "hf_model"}


def command_lines(page: Path) -> list[str]:
    """The page's shell lines that run something (comments and blank lines left out)."""
    _, shell = _split(page)
    return [line for line in shell if line and not line.startswith("#")]


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


# --- the clone ---------------------------------------------------------------------------------


def environment(clone: Path) -> dict[str, str]:
    return os.environ | {
        "OMP_NUM_THREADS": "1",
        "SHARDTUNE_CACHE": str(clone / ".cache"),
        "PYTHONPATH": str(REPO),
    }


def users_files(clone: Path) -> None:
    """What a user brings: a jsonl file, one of preference pairs and a parquet file of them, a
    folder ``datasets.load_dataset`` reads with other column names, a parquet file of those
    columns, and a Hugging Face model folder (the hf/ of the clone's finished run)."""
    records = [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}."} for i in range(200)]
    (clone / "my.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs = [
        {"prompt": r["prompt"], "chosen": r["response"], "rejected": f"{2 * i + 1}."}
        for i, r in enumerate(records)
    ]
    (clone / "my_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    by_column = {key: [pair[key] for pair in pairs] for key in ("prompt", "chosen", "rejected")}
    pq.write_table(pa.table(by_column), clone / "my_pairs.parquet")  # dpo.md's data=hf
    (clone / "my_folder").mkdir()
    renamed = [{"instruction": r["prompt"], "output": r["response"]} for r in records]
    (clone / "my_folder" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    columns = {key: [record[key] for record in renamed] for key in ("instruction", "output")}
    pq.write_table(pa.table(columns), clone / "general.parquet")  # data.md's mixture's
    finished = next((clone / "outputs" / "llama").glob("*/hf"))
    (clone / "hf_model").symlink_to(finished)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder standing for a fresh clone after ``make run``."""
    folder = tmp_path_factory.mktemp("clone")
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    (folder / ".venv").symlink_to(VENV)
    run_line(folder, "make run")
    users_files(folder)
    return folder


# --- running one line --------------------------------------------------------------------------


def tiny(arguments: list[str]) -> list[str]:
    """The overrides that make a recipe line tiny: a few steps, unless it sets them or plans."""
    if "dry_run=true" in arguments or any(a.startswith("train.max_steps=") for a in arguments):
        return []
    steps = TINY_STEPS
    for argument in arguments:
        if fault := re.fullmatch(r"debug\.fault=\w+@(\d+)", argument):
            steps = max(steps, int(fault.group(1)) + 1)
        if profiled := re.fullmatch(r"profile\.steps=\[\d+,(\d+)\]", argument):
            steps = max(steps, int(profiled.group(1)))
    return [f"train.max_steps={steps}"]


def placed(arguments: list[str], clone: Path) -> list[str]:
    for placeholder, name in PLACEHOLDERS.items():
        arguments = [a.replace(placeholder, str(clone / name)) for a in arguments]
    return arguments


def kind(words: list[str]) -> str:
    """What a line runs: ``recipe``, ``torchrun``, ``make``, ``pytest`` or ``python -c``; an
    AssertionError for a line written otherwise."""
    head, arguments = words[0], words[1:]
    assert head in (".venv/bin/python", ".venv/bin/torchrun", "make"), (
        f"{head}: write .venv/bin/python or .venv/bin/torchrun (a bare one is not the venv's)"
    )
    if head == ".venv/bin/torchrun":
        assert set(RECIPES) & set(arguments), "torchrun runs a recipe"
        return "torchrun"
    found = {"make": head == "make", "recipe": bool(arguments) and arguments[0] in RECIPES}
    found |= {"pytest": arguments[:2] == ["-m", "pytest"], "python -c": arguments[:1] == ["-c"]}
    assert any(found.values()), f"no way to run {words} here: teach tests/e2e/{Path(__file__).name}"
    return next(name for name, matches in found.items() if matches)


def run_words(clone: Path, words: list[str]) -> subprocess.CompletedProcess:
    """One command as written (``.venv/bin/...``), through the warm interpreter where it can."""
    env, python = environment(clone), str(VENV / "bin" / "python")
    what, arguments = kind(words), placed(words[1:], clone)
    assert what == "make" or (clone / words[0]).exists(), f"{words[0]} is not in the venv"
    if what == "make":
        return run_make(clone, arguments, env)
    command = [python, *arguments]  # pytest is collected only: it is a lane of the suite
    if what == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", *arguments, *tiny(arguments)]
        env = cli.warm_torchrun_environment(env)
    elif what == "recipe":
        command = [sys.executable, *arguments, *tiny(arguments)]
    elif what == "pytest":
        command += ["--collect-only", "-q", "-p", "no:cacheprovider"]
    return cli.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def run_make(clone: Path, arguments: list[str], env: dict) -> subprocess.CompletedProcess:
    """``make -n`` for every target (what it would run); ``help`` runs; ``run`` runs its recipe
    command (the line ``make -n`` prints for it)."""
    dry = subprocess.run(
        ["make", "-n", *arguments], cwd=clone, env=env, capture_output=True, text=True
    )
    if dry.returncode != 0 or arguments[:1] not in (["help"], ["run"]):
        return dry
    if arguments[:1] == ["help"]:
        return subprocess.run(
            ["make", *arguments], cwd=clone, env=env, capture_output=True, text=True
        )
    printed = [line for line in dry.stdout.splitlines() if RECIPE in line]
    assert len(printed) == 1, dry.stdout
    return run_words(clone, words_of(printed[0]))


def words_of(line: str) -> list[str]:
    line = re.sub(r"(^|\s)#.*$", "", line)
    words = shlex.split(line)
    if words[:1] == ["timeout"]:  # timeout DURATION command: the run's own timeout stands for it
        words = words[2:]
    return words


def not_run(line: str) -> str | None:
    """Why the docs lane does not run ``line``: it cannot run here, or a marker's test runs it."""
    marked = {text: f"-m {marker}: {why}" for text, (marker, why) in MARKED.items()}
    return next((why for text, why in (NOT_RUN | marked).items() if text in line), None)


def marker_of(line: str) -> str | None:
    """The opt-in marker whose test runs ``line`` (:data:`MARKED`), or None."""
    return next((marker for text, (marker, _) in MARKED.items() if text in line), None)


def run_line(clone: Path, line: str) -> None:
    """Run ``line`` in ``clone``; fail, naming it, unless it ended as it should."""
    started = time.monotonic()
    result = run_words(clone, words_of(line))
    print(f"{time.monotonic() - started:5.1f} s  {line}")  # shown with -s, or when a test fails
    expected, said = next((f for text, f in EXPECTED_FAILURES.items() if text in line), (0, ""))
    assert result.returncode == expected and said in result.stderr, (
        f"`{line}` exited {result.returncode} (expected {expected}):\n{result.stderr[-3000:]}"
    )


def run_page(clone: Path, page: Path, only: set[str] | None = None) -> None:
    """Run the page's lines in order (``only``: those alone), but those :data:`NOT_RUN` names."""
    for line in command_lines(page):
        if (only is None or line in only) and not not_run(line):
            run_line(clone, line)


# --- the tests ---------------------------------------------------------------------------------


# What make test runs for real (the full set: pytest -m docs): the user's own data, a dry run, a
# multi-rank layout (HSDP); `make run` runs as the clone's first line. Not torchrun (~18 s a line):
# test_every_command_line_is_one_this_test_can_run checks how its lines are written.
REPRESENTATIVE = [
    (
        "README.md",
        ".venv/bin/python recipes/finetune.py data=jsonl data.path=my.jsonl",
    ),
    (
        "README.md",
        ".venv/bin/python recipes/finetune.py dry_run=true tp=4 dp=16 train.micro_batch_size=1 "
        "device_memory_gib=80",
    ),
    (
        "docs/parallelism.md",
        ".venv/bin/python recipes/finetune.py dp_replicate=2 dp_shard=2 train.micro_batch_size=4",
    ),
]


def lines_of(page: str, start: str) -> list[str]:
    """The page's command lines that start with ``start`` (one, or the test is out of date)."""
    found = [
        line for line in command_lines(REPO / page) if " ".join(line.split()).startswith(start)
    ]
    assert len(found) == 1, f"{page} has {len(found)} lines starting {start!r}"
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_command_line_is_one_this_test_can_run(page):
    """Every line is written with the venv's programs and is a kind the runner knows, or
    :data:`NOT_RUN` names it; every make target exists (``make -n``); nothing runs."""
    for line in command_lines(page):
        if not_run(line):
            continue
        words = words_of(line)
        if kind(words) == "make":
            dry = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True)
            assert dry.returncode == 0, f"{page_id(page)}: `{line}`: {dry.stderr.decode()}"


@pytest.mark.parametrize("page, start", REPRESENTATIVE, ids=lambda value: value[:40])
def test_a_representative_command_line_runs_as_written(clone, page, start):
    """Each at a tiny size in the clone, as the opt-in test runs every line."""
    run_page(clone, REPO / page, only=set(lines_of(page, start)))


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_command_line_of_the_page_runs_as_written(clone, page):
    """The page's lines in order, in the clone the pages before it left (README first)."""
    run_page(clone, page)


@pytest.mark.parametrize(
    "marker", [pytest.param(name, marks=getattr(pytest.mark, name)) for name in ("cuda", "smollm2")]
)
def test_the_lines_an_opt_in_machine_runs_run_as_written(clone, marker):
    """The lines :data:`MARKED` with ``marker``, each at a tiny size in the clone, where that
    marker's tests run (a GPU; the package index)."""
    lines = [line for page in PAGES for line in command_lines(page) if marker_of(line) == marker]
    assert lines
    for line in lines:
        run_line(clone, line)


def test_a_bare_python_outside_the_venv_says_to_use_the_venv():
    """``python recipes/finetune.py`` with an interpreter that lacks the project: one line."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", RECIPE, "tp=2"],  # -S: no site-packages, no project
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert ".venv/bin/python recipes/finetune.py" in result.stderr
