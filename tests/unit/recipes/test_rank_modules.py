"""``RANK_MODULES`` (recipes/finetune.py) names every module the rank functions import inside
themselves, so the launcher imports each once before it forks the ranks instead of once per rank;
a module added to a rank function and not to the list is caught here. The driver's own functions
(checking, planning, the sweep's summary) are left out: they never run on a rank."""

import ast
import importlib.util
from pathlib import Path

from recipes.finetune import RANK_MODULES

FINETUNE = Path(__file__).resolve().parents[3] / "recipes" / "finetune.py"
DRIVER_FUNCTIONS = {"launch", "hydra_main", "sweep_job", "sweep_summary", "end_sweep"}


def _imported_module(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    modules = []
    for alias in node.names:  # `from package import submodule` imports the submodule
        name = f"{node.module}.{alias.name}"
        is_module = importlib.util.find_spec(node.module).submodule_search_locations is not None
        is_module = is_module and importlib.util.find_spec(name) is not None
        modules.append(name if is_module else node.module)
    return modules


def rank_function_imports() -> set[str]:
    tree = ast.parse(FINETUNE.read_text())
    found = set()
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef) or function.name in DRIVER_FUNCTIONS:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.update(_imported_module(node))
    return found


def test_every_module_a_rank_function_imports_is_listed():
    imported = rank_function_imports()
    assert "components.training.step" in imported  # the walk sees the rank functions
    missing = sorted(imported - set(RANK_MODULES))
    assert not missing, f"add to RANK_MODULES in recipes/finetune.py: {missing}"


def test_nothing_is_listed_that_no_rank_function_imports():
    extra = sorted(set(RANK_MODULES) - rank_function_imports())
    assert not extra, f"remove from RANK_MODULES in recipes/finetune.py: {extra}"
