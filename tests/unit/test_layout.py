"""The code stays readable: short functions, a short recipe, public seams between modules."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*REPO.glob("recipes/*.py"), *REPO.glob("components/**/*.py")])
MAX_FUNCTION_LINES = 60
MAX_DOCSTRING_LINES = 15
MAX_FILE_LINES = 600  # issue 45: no product file over 600 lines


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _body_lines(function: ast.FunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = function.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
    ):
        body = body[1:] or body
    return function.end_lineno - body[0].lineno + 1


def test_no_product_file_is_longer_than_600_lines():
    long = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in SOURCES}
    assert {path: lines for path, lines in long.items() if lines > MAX_FILE_LINES} == {}


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_no_function_is_longer_than_60_lines(path):
    tree = ast.parse(path.read_text())
    long = [
        f"{f.name} ({_body_lines(f)} lines)"
        for f in _functions(tree)
        if _body_lines(f) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: {', '.join(long)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_a_module_docstring_says_what_the_module_owns_in_15_lines(path):
    lines = len((ast.get_docstring(ast.parse(path.read_text()), clean=False) or "").splitlines())
    assert lines <= MAX_DOCSTRING_LINES, (
        f"{path.name}: module docstring of {lines} lines; history and rationale go to "
        "docs/design-notes.md"
    )


def test_every_module_that_points_to_the_design_notes_has_its_section_there():
    notes = (REPO / "docs/design-notes.md").read_text().splitlines()
    pointing = [
        str(path.relative_to(REPO))
        for path in SOURCES
        if "docs/design-notes.md" in (ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert pointing
    assert [module for module in pointing if f"## {module}" not in notes] == []


def _is_dataclass_decorator(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("dataclass", "dataclasses.dataclass")


def _declares_kw_only(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and any(
        keyword.arg == "kw_only" and getattr(keyword.value, "value", None) is True
        for keyword in decorator.keywords
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_dataclass_is_keyword_only(path):
    positional = [
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        for decorator in node.decorator_list
        if _is_dataclass_decorator(decorator) and not _declares_kw_only(decorator)
    ]
    assert not positional, f"{path.name}: declare @dataclass(kw_only=True): {', '.join(positional)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_no_module_imports_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith(("components", "recipes"))
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not private, f"{path.name} imports private names: {', '.join(private)}"
