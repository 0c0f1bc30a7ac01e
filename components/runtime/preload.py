"""Import, before the ranks are forked, what a recipe's functions import inside themselves (so
that ``--help`` stays light): each module once in the launcher, shared by every forked rank,
instead of once per rank. The list is read from the recipe's source, never kept by hand."""

import ast
import importlib
import importlib.util
from pathlib import Path


def function_imports(source: Path) -> list[str]:
    """Every module an ``import`` inside a function of ``source`` names, sorted (``from package
    import submodule`` names the submodule)."""
    tree = ast.parse(Path(source).read_text())
    found: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.update(_from_import(node.module, [alias.name for alias in node.names]))
    return sorted(found)


def _from_import(module: str, names: list[str]) -> list[str]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.submodule_search_locations is None:
        return [module]
    return [
        f"{module}.{name}" if importlib.util.find_spec(f"{module}.{name}") else module
        for name in names
    ]


def preload(*sources: Path) -> None:
    """Import what the functions of every file in ``sources`` import."""
    for source in sources:
        for module in function_imports(source):
            importlib.import_module(module)
