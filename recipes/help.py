"""``python recipes/finetune.py --help`` (and ``dpo.py``'s): the config groups and their options
(``conf/``, the recipe's defaults marked), then the keys most runs touch, one line each, as the
recipe's schema declares them (``recipes/schema.py``: each key declared with what it sets,
``common=``). Hydra's own page stays at ``--hydra-help``."""

from pathlib import Path

import yaml
from pydantic import BaseModel

from recipes.schema import COMMON, Config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
USAGE = "usage: python recipes/{script} [GROUP=OPTION ...] [KEY=VALUE ...]"
FLAGS = """Flags:
  --cfg job          print the composed config (every key and its value) and exit
  --multirun K=A,B   one run per value, each in its own folder
  --hydra-help       Hydra's own options"""


def page(
    conf_dir: Path = CONF_DIR,
    script: str = "finetune.py",
    name: str = "config",
    schema: type[BaseModel] = Config,
) -> str:
    """The whole ``--help`` page of the recipe ``script``, whose primary config is
    ``conf/<name>.yaml`` (``conf/config.yaml``, or one that composes it and overrides groups) and
    whose schema is ``schema``."""
    config = yaml.safe_load((conf_dir / "config.yaml").read_text())
    own = yaml.safe_load((conf_dir / f"{name}.yaml").read_text()) if name != "config" else {}
    for entry in own.get("defaults", []):  # `override data: preference`: the recipe's default
        if isinstance(entry, dict):
            config["defaults"] += [{k.removeprefix("override "): v for k, v in entry.items()}]
    keys = common_keys(schema)
    width = max(len(name) for name, _ in keys)
    lines = [config["hydra"]["help"]["header"].rstrip(), USAGE.format(script=script), ""]
    lines += ["Groups (GROUP=OPTION; * marks the default):", *group_lines(conf_dir, config), ""]
    lines += ["Keys most runs touch (KEY=VALUE; types and ranges: recipes/schema.py):"]
    lines += [f"  {name:<{width}}  {sets}" for name, sets in keys]
    return "\n".join([*lines, "", FLAGS])


def common_keys(section: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, what it sets) of each key of ``section`` and its subsections declared with
    ``common=``, in declaration order."""
    found = []
    for name, field in section.model_fields.items():
        dotted = f"{prefix}{field.alias or name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found += common_keys(field.annotation, f"{dotted}.")
        elif isinstance(field.json_schema_extra, dict) and COMMON in field.json_schema_extra:
            found.append((dotted, field.json_schema_extra[COMMON]))
    return found


def group_lines(conf_dir: Path, config: dict) -> list[str]:
    """One line per folder of ``conf_dir``: its options, the default marked; a subfolder's files
    as ``folder/NAME`` with their count."""
    chosen = {}
    for entry in config["defaults"]:
        if isinstance(entry, dict):
            chosen |= entry
    lines = []
    for folder in sorted(path for path in conf_dir.iterdir() if path.is_dir()):
        names = [path.stem + ("*" if path.stem == chosen.get(folder.name) else "") for path in
                 sorted(folder.glob("*.yaml"))]  # fmt: skip
        for nested in sorted(path for path in folder.iterdir() if path.is_dir()):
            names.append(f"{nested.name}/NAME ({len(list(nested.glob('*.yaml')))})")
        lines.append(f"  {folder.name + '=':<12}{', '.join(names)}")
    return lines
