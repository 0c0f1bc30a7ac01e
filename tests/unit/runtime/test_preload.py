"""The launcher imports what a recipe's functions import inside themselves, read from the source:
a module added to a rank function is preloaded without a list to keep."""

import subprocess
import sys
from pathlib import Path

from components.runtime.preload import function_imports

REPO = Path(__file__).resolve().parents[3]


def test_the_imports_inside_functions_are_found(tmp_path):
    source = tmp_path / "recipe.py"
    source.write_text(
        "import json\n\n"
        "def rank():\n"
        "    import yaml\n"
        "    from components.training import step\n"
        "    from components.training.metrics import throughput\n"
    )
    found = function_imports(source)
    assert found == ["components.training.metrics", "components.training.step", "yaml"]


def test_preloading_the_recipe_imports_what_its_launch_imports():
    code = (
        "import sys\n"
        "from components.runtime.preload import preload\n"
        f"preload({str(REPO / 'recipes' / 'finetune.py')!r})\n"
        "print('components.planning.dry_run' in sys.modules, 'components.runtime.ranks' in"
        " sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "True"]
