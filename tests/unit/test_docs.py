"""The docs name only what exists: every repository path, link, anchor and config key in README.md,
BENCHMARKS.md and docs/*.md is real.

Paths and keys are read from inline code spans and from shell code blocks; links from markdown link
syntax. A key is checked against the config schema (``recipes.schema.Config``: its models' fields
and aliases), plus, for groups chosen by ``_target_``, the keys of their ``conf/`` files and the
signatures of the classes those files name; ``model.config.*`` against the Hugging Face configs of
the families in ``conf/model/``. Group options (``model=llama``) must be files of their ``conf/``
group. The dated history page is exempt from key and path checks (it records past commands).
"""

import importlib
import inspect
import re
import shlex
import typing
from functools import cache
from pathlib import Path

import pytest
import transformers
import yaml
from pydantic import BaseModel

from recipes.schema import Config

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
HISTORY = REPO / "docs" / "benchmarks-history.md"
CHECKED = [page for page in PAGES if page != HISTORY]
# Copies of the binding specs, kept verbatim: their in-page anchors are the source site's.
SPEC_COPIES = {"recipe-contract.md", "tp_replicas-api.md", "tp_replicas-notes.md"}
ROOTS = ("components", "recipes", "conf", "bench", "tests", "docs", "examples")
# File suffixes: `model.safetensors` or `data.jsonl` is a file name, not the key model.safetensors.
FILE_SUFFIXES = {
    "json", "jsonl", "yaml", "py", "md", "png", "safetensors", "txt", "npz", "bin", "gguf",
    "distcp", "tmp", "abandoned", "sbatch", "sh", "metadata", "lock",
}  # fmt: skip
# Bad input the docs show on purpose (what the error line says about it).
DELIBERATELY_WRONG = {"train.max_stpes", "model=gpt5"}
KEY = re.compile(r"^\+{0,2}([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:=(.*))?$")
PATH = re.compile(rf"^(?:\./)?((?:{'|'.join(ROOTS)})/[\w./*-]*)$")
MODULE = re.compile(r"^(components(?:\.\w+)+)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
SHELL = {"", "bash", "sh", "shell", "console"}
ENTRY_POINTS = ("recipes/finetune.py", "examples/slurm/finetune.sbatch")


def _split(page: Path) -> tuple[list[str], list[str]]:
    """The page's prose lines and the lines of its shell code blocks (continuations joined)."""
    prose, shell, fence, joined = [], [], None, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence is None:
            prose.append(line)
        elif fence in SHELL:
            joined += line.rstrip("\\").rstrip() + " "
            if not line.endswith("\\"):
                shell.append(joined.strip())
                joined = ""
    return prose, shell


def _shell_words(line: str) -> list[str]:
    line = re.sub(r"(^|\s)#.*$", "", line)
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _span_words(prose: list[str]) -> list[str]:
    return [word for line in prose for span in SPAN.findall(line) for word in span.split()]


def _clean(word: str) -> str:
    return word.strip("\"'()[],;:").rstrip(".")


def _bare_paths(prose: list[str]) -> list[str]:
    """Repository paths written outside code spans and links (headings, plain text)."""
    text = "\n".join(LINK.sub("", SPAN.sub("", line)) for line in prose)
    return re.findall(rf"(?<![\w/.-])(?:{'|'.join(ROOTS)})/[\w./*-]*", text)


def _words(page: Path) -> tuple[list[str], list[list[str]]]:
    """Words of the page's code spans, shell lines and bare paths, and the shell lines as word
    lists."""
    prose, shell = _split(page)
    lines = [_shell_words(line) for line in shell]
    words = _span_words(prose) + [w for ws in lines for w in ws] + _bare_paths(prose)
    return [_clean(w) for w in words], lines


# --- the schema's keys -------------------------------------------------------------------------


def _unwrap(annotation) -> list:
    """Every type inside an annotation (unions, Optional, Annotated, containers)."""
    args = typing.get_args(annotation)
    return [annotation] + [inner for arg in args for inner in _unwrap(arg)]


def _section(annotation) -> type[BaseModel] | None:
    return next(
        (t for t in _unwrap(annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None
    )


def _choices(annotation) -> set | None:
    """The values a Literal (or bool) field takes, None for any other field."""
    values = [
        arg
        for t in _unwrap(annotation)
        if typing.get_origin(t) is typing.Literal
        for arg in typing.get_args(t)
    ]
    if bool in _unwrap(annotation):
        values += [True, False]
    if not values:
        return None
    if type(None) in _unwrap(annotation):
        values.append(None)
    return {yaml.safe_load(str(v)) if isinstance(v, str) else v for v in values}


def _fields(model: type[BaseModel]) -> dict:
    return {info.alias or name: info.annotation for name, info in model.model_fields.items()}


@cache
def _group_extras(group: str) -> frozenset[str]:
    """Keys a `_target_` (or otherwise open) group takes: its conf files' keys and the parameters
    of the classes they name."""
    keys = set()
    for path in (REPO / "conf" / group).glob("*.yaml"):
        values = yaml.safe_load(path.read_text()) or {}
        keys |= set(values)
        target = values.get("_target_")
        if target:
            module, _, name = target.rpartition(".")
            target_class = getattr(importlib.import_module(module), name)
            keys |= set(inspect.signature(target_class).parameters)
    return frozenset(keys)


@cache
def _hf_config_keys() -> frozenset[str]:
    """Attributes of the Hugging Face configs of every family conf/model/ names."""
    families = {
        (yaml.safe_load(path.read_text()) or {}).get("family")
        for path in (REPO / "conf" / "model").glob("*.yaml")
    }
    keys = set()
    for family in sorted(f for f in families if f):
        config = transformers.CONFIG_MAPPING[family]()
        keys |= set(config.to_dict()) | {k for k in dir(config) if not k.startswith("_")}
    return frozenset(keys)


def _group_options(group: str) -> set[str]:
    folder = REPO / "conf" / group
    return {str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")}


def _dotted_problem(dotted: str, value: str | None) -> str | None:
    """Why `dotted` (=value) is not a key of the config, or None when it is."""
    parts, model, annotation = dotted.split("."), Config, None
    if parts[:2] == ["model", "config"] and len(parts) > 2:
        return None if parts[2] in _hf_config_keys() else f"{dotted}: no HF config has {parts[2]}"
    for i, part in enumerate(parts):
        fields = _fields(model)
        if part not in fields:
            if model.model_config.get("extra") == "allow" and part in _group_extras(parts[0]):
                return None
            return f"{dotted}: {'.'.join(parts[:i]) or 'the config'} has no key {part}"
        annotation = fields[part]
        model = _section(annotation)
        if model is None and i < len(parts) - 1:
            return f"{dotted}: {'.'.join(parts[: i + 1])} has no keys below it"
    return _value_problem(dotted, annotation, value)


def _value_problem(dotted: str, annotation, value: str | None) -> str | None:
    choices = _choices(annotation)
    if value is None or choices is None or not re.fullmatch(r"[a-z0-9_.-]+", value):
        return None
    return None if yaml.safe_load(value) in choices else f"{dotted}={value}: not one of {choices}"


def _bare_problem(name: str, value: str | None, strict: bool) -> str | None:
    """A top-level key or a group choice (`tp=2`, `model=llama`); unknown words only in commands."""
    if (REPO / "conf" / name).is_dir():
        if value is None or not re.fullmatch(r"[a-z0-9_/,-]+", value):
            return None
        wrong = [v for v in value.split(",") if v not in _group_options(name) and v != "null"]
        return f"{name}={value}: conf/{name}/ has no {', '.join(wrong)}" if wrong else None
    if name in _fields(Config):
        return _value_problem(name, _fields(Config)[name], value)
    return f"{name}={value}: not a key of the config" if strict and value is not None else None


def _key_problem(word: str, strict: bool = False) -> str | None:
    match = KEY.match(word)
    if not match or word in DELIBERATELY_WRONG:
        return None
    dotted, value = match.groups()
    if dotted.split(".")[0] == "hydra" or dotted in DELIBERATELY_WRONG:
        return None
    if "." not in dotted:
        return _bare_problem(dotted, value, strict)
    sections = {name for name, ann in _fields(Config).items() if _section(ann)}
    if dotted.split(".")[0] not in sections or dotted.rsplit(".")[-1] in FILE_SUFFIXES:
        return None
    return _dotted_problem(dotted, value)


def _command_overrides(lines: list[list[str]]) -> list[str]:
    """The `key=value` words after an entry point on a shell line: each a Hydra override."""
    overrides = []
    for words in lines:
        starts = [i for i, word in enumerate(words) if word in ENTRY_POINTS]
        if starts:
            overrides += [w for w in words[starts[0] + 1 :] if "=" in w and not w.startswith("-")]
    return overrides


# --- paths and links ---------------------------------------------------------------------------


def _path_problem(word: str) -> str | None:
    match = PATH.match(word)
    if not match or "..." in word:
        return None
    path = match.group(1)
    found = list(REPO.glob(path.rstrip("/"))) if "*" in path else [REPO / path]
    return None if any(p.exists() for p in found) else f"{path} does not exist"


@cache
def _python_files() -> frozenset[str]:
    return frozenset(p.name for root in ROOTS for p in (REPO / root).rglob("*.py"))


def _file_name_problem(word: str) -> str | None:
    """A bare `name.py`: some file of the repository has that name."""
    if not re.fullmatch(r"[\w-]+\.py", word):
        return None
    return None if word in _python_files() else f"{word}: no such file in the repository"


def _module_problem(word: str) -> str | None:
    """`components.x.y`: a module, or a name its package's __init__ holds."""
    match = MODULE.match(word)
    if not match:
        return None
    here = REPO
    for part in match.group(1).split("."):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            return None
        elif here != REPO and part in (here / "__init__.py").read_text():
            return None
        else:
            return f"{word}: no module or package {here.relative_to(REPO) / part}"
    return None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose, _ = _split(page)
    seen, anchors = {}, set()
    for line in prose:
        if re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _link_problem(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return f"{target}: links outside the repository (a clone must stand alone)"
    file, _, anchor = target.partition("#")
    path = (page.parent / file).resolve() if file else page
    if not path.exists() or not path.is_relative_to(REPO):
        return f"{target}: no such file in the repository"
    if path.name in SPEC_COPIES and not file:
        return None
    if anchor and path.suffix == ".md" and anchor not in _anchors(path):
        return f"{target}: {path.name} has no heading #{anchor}"
    return None


# --- the tests ---------------------------------------------------------------------------------


def _ids(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_link_and_anchor_leads_to_a_file_of_the_repository(page):
    prose, _ = _split(page)
    problems = [_link_problem(page, t) for line in prose for t in LINK.findall(line)]
    assert [p for p in problems if p] == []


@pytest.mark.parametrize("page", CHECKED, ids=_ids)
def test_every_path_and_module_named_exists(page):
    words, _ = _words(page)
    problems = [_path_problem(w) or _module_problem(w) or _file_name_problem(w) for w in words]
    assert [p for p in problems if p] == []


@pytest.mark.parametrize("page", CHECKED, ids=_ids)
def test_every_config_key_named_is_a_key_of_the_schema(page):
    words, lines = _words(page)
    problems = [_key_problem(w) for w in words]
    problems += [_key_problem(_clean(w), strict=True) for w in _command_overrides(lines)]
    assert [p for p in problems if p] == []


WRONG = [
    "train.max_stepz=3", "model.config.hiden_size=8", "checkpoint.resume.auto", "sp=maybe",
    "train.precision=fp4", "model=gpt4", "components.data.nowhere", "conf/model/gpt4.yaml",
    "replica_plan.py",
]  # fmt: skip


@pytest.mark.parametrize("word", WRONG)
def test_a_wrong_key_or_path_is_caught(word):
    found = _key_problem(word, strict=True) or _path_problem(word) or _module_problem(word)
    assert found or _file_name_problem(word)


def test_the_readme_and_benchmarks_stay_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    assert len((REPO / "BENCHMARKS.md").read_text().splitlines()) <= 300
