"""The recipe tells the story of a run and stays short: the command (``recipes/finetune.py``) reads
compose -> check -> prepare -> dry run or ranks, calling functions; what each rank runs
(``recipes/finetune_rank.py``) reads set up -> train -> finish. The command line, launching,
sweeps, restarts and exit statuses are ``components/runtime``'s, where a second recipe reuses them.
Imports sit at the top of their module, but for the exceptions listed, with their measured cost, in
docs/design-notes.md ("Start-up imports")."""

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
COMMAND, STORY = REPO / "recipes" / "finetune.py", REPO / "recipes" / "finetune_rank.py"


def functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_recipe_is_at_most_300_lines():
    for path in (COMMAND, STORY):
        assert len(path.read_text().splitlines()) <= 300, path


def test_the_recipe_has_the_seams_of_the_next_capabilities():
    story = functions(STORY)
    assert {"set_up", "train_step", "train", "finish", "convert", "rank_main"} <= set(story)
    step_arguments = [argument.arg for argument in story["train"].args.args]
    assert "steps" in step_arguments  # a pipeline schedule, DPO's or distillation's step


def test_the_command_calls_each_phase_itself():
    command = functions(COMMAND)
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        for function in command.values()
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
    }
    assert {"compose", "check", "prepare", "shared_plan", "dry_run", "run_ranks"} <= called


def function_imports() -> Counter:
    """Every ``import`` inside a function under components/ and recipes/, counted per file."""
    found = Counter()
    for path in sorted([*REPO.glob("components/**/*.py"), *REPO.glob("recipes/*.py")]):
        lines = {
            node.lineno
            for function in ast.walk(ast.parse(path.read_text()))
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(function)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        found[str(path.relative_to(REPO))] += len(lines)
    return +found


def test_every_import_inside_a_function_is_a_listed_exception():
    notes = (REPO / "docs" / "design-notes.md").read_text()
    section = notes.split("## Start-up imports")[1].split("\n## ")[0]
    listed = {path: int(count) for path, count in re.findall(r"`([\w/]+\.py)` \((\d+)\)", section)}
    found = function_imports()
    assert found == listed
    assert sum(found.values()) <= 40  # a new one replaces an old one, or moves to the top
