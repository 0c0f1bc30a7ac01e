"""What bench/gpu_check.sh runs with: the interpreter, torch and its devices, and every installed
version against pyproject.toml's ranges and the carried wheels' own requirements.

Why: on the lent GPU machine the code runs on the image's packages plus the wheels in .whl/
(installed with --no-deps), so nothing else checks that they fit together. A project range that
is not met is an error (exit 1); a carried wheel's unmet requirement is a warning line.
Run: ``python bench/gpu_env.py [WHEEL_DIR]``.
"""

import importlib.metadata as metadata
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def unmet(requirement: Requirement) -> str | None:
    """Why ``requirement`` is not met here, or None (also when its marker excludes this Python)."""
    if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
        return None
    try:
        found = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return f"{requirement} (not installed)"
    if requirement.specifier.contains(found, prereleases=True):
        return None
    return f"{requirement} (found {found})"


def installed(name: str) -> str:
    """The installed version of ``name``, or "-"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist lines, read from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    lines = [
        line.split(":", 1)[1] for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [Requirement(line.strip()) for line in lines]


def main() -> int:
    import torch

    cuda = torch.cuda.is_available()
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); CUDA available: {cuda}")
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        print(f"  cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    failed = []
    for requirement in map(Requirement, project):
        why = unmet(requirement)
        failed += [why] if why else []
        print(f"  {requirement.name:<16} {installed(requirement.name):<12} wants {requirement}")
    wheels = sorted(Path(sys.argv[1]).glob("*.whl")) if len(sys.argv) > 1 else []
    warnings = sorted(
        {why for wheel in wheels for why in map(unmet, wheel_requirements(wheel)) if why}
    )
    for why in warnings:
        print(f"warning: a carried wheel needs {why}")
    for why in failed:
        print(f"error: pyproject.toml needs {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
