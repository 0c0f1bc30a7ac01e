"""The recipe's malloc settings (components/runtime/malloc.py): added where the user chose none,
kept where they did, and applied by executing the command again."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from components.runtime.malloc import TUNABLES, malloc_environment

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's settings")
REPO = str(Path(__file__).resolve().parents[3])


def test_added_after_other_tunables():
    environment = malloc_environment({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert environment["GLIBC_TUNABLES"] == ":".join(("glibc.pthread.rseq=0", *TUNABLES))
    assert environment["PATH"] == "/bin"
    assert malloc_environment({})["GLIBC_TUNABLES"] == ":".join(TUNABLES)


@pytest.mark.parametrize(
    "given",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"},  # glibc's defaults, asked for
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_ARENA_MAX": "1"},
    ],
)
def test_the_users_choice_is_kept(given):
    assert malloc_environment(given) is None


def test_the_command_runs_again_with_them():
    code = (
        "from components.runtime.malloc import exec_with_malloc_settings\n"
        "exec_with_malloc_settings()\n"
        "import os, sys; print(os.environ['GLIBC_TUNABLES'], sys.argv[1:])"
    )
    environment = {key: value for key, value in os.environ.items() if "MALLOC" not in key}
    environment = {**environment, "PYTHONPATH": REPO, "GLIBC_TUNABLES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code, "a", "b=1"], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{':'.join(TUNABLES)} ['a', 'b=1']\n"


def imports_in_order(*arguments: str) -> list[str]:
    """The modules ``python -X importtime recipes/finetune.py ARGUMENTS`` imported, in order, in
    each process it became (the environment has no malloc setting of its own)."""
    environment = {key: value for key, value in os.environ.items() if "MALLOC" not in key}
    environment = {**environment, "PYTHONPATH": REPO, "GLIBC_TUNABLES": ""}
    command = [sys.executable, "-X", "importtime", "recipes/finetune.py", *arguments]
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    lines = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time")]
    return [parts[-1].strip() for parts in lines if len(parts) == 3]


def test_a_run_executes_itself_once_before_torch_and_help_never():
    run = imports_in_order("trian.max_steps=3")  # refused after the exec, before any rank
    assert run.count("hydra") == 2 and "torch" in run
    assert run.index("torch") > len(run) - 1 - run[::-1].index("hydra")  # after the exec
    help_ = imports_in_order("--help")
    assert help_.count("hydra") == 1 and "torch" not in help_
