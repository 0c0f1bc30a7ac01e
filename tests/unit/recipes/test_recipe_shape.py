"""The recipe tells the story of a run and stays short: the command line, launching, sweeps,
restarts and exit statuses are ``components/runtime``'s, where a second recipe reuses them."""

import ast
from pathlib import Path

FINETUNE = Path(__file__).resolve().parents[3] / "recipes" / "finetune.py"


def test_the_recipe_is_at_most_300_lines():
    assert len(FINETUNE.read_text().splitlines()) <= 300


def test_the_recipe_has_the_seams_of_the_next_capabilities():
    functions = {
        node.name: node
        for node in ast.parse(FINETUNE.read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    assert {"set_up", "train_step", "train", "finish", "convert"} <= set(functions)
    step_arguments = [argument.arg for argument in functions["train"].args.args]
    assert "step_fn" in step_arguments  # a pipeline schedule replaces the step function
