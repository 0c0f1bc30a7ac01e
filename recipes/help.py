"""``python recipes/finetune.py --help`` (and ``dpo.py``'s, ``distill.py``'s): what the recipe does,
the config groups and their options (``conf/``, the recipe's defaults marked; of ``data=``, the
options the recipe reads; of ``experiment=``, the recipe's own examples), then the keys most runs
touch, one line each, as the recipe's schema declares them (``recipes/schema.py``: each key
declared with what it sets, ``common=``), less the ones the recipe refuses or does not read.
Hydra's own page stays at ``--hydra-help``."""

from dataclasses import dataclass, field
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


@dataclass(frozen=True, kw_only=True)
class RecipePage:
    """What one recipe's page says of it: what it does, a regression recipe it runs, the
    ``data=`` options it reads (the data checks accept those alone), the common keys it refuses
    away from their defaults or never reads (not listed; with the degrees its schema runs at 1
    only, ``DEGREES_AT_ONE``), and common keys it reads otherwise than ``finetune.py`` (what they
    set for it)."""

    does: str
    regression: str
    data: tuple[str, ...]
    unread: tuple[str, ...] = ()
    sets: dict[str, str] = field(default_factory=dict)


PAGES = {
    "finetune.py": RecipePage(
        does="fine-tuning (full, LoRA or QLoRA) of Hugging Face causal LMs with tensor parallelism",
        regression="llama_tp2",
        data=("default", "hf", "jsonl", "mix"),
    ),
    "dpo.py": RecipePage(
        does="DPO, preference tuning of Hugging Face causal LMs against a frozen reference, with "
        "tensor parallelism (docs/dpo.md)",
        regression="dpo_llama_tp1",
        data=("hf", "jsonl", "preference"),
        unread=("train.packing", "data.loss_on"),
        sets={
            "train.val_every": "steps between validations on the held-out pairs (and after the "
            "last step); 0: never",
            "train.global_batch_size": "preference pairs per optimizer step",
            "train.micro_batch_size": "pairs per forward pass per dp rank (2 rows each: chosen "
            "and rejected)",
            "train.seq_len": "tokens per conversation (a prompt and one answer)",
        },
    ),
    "distill.py": RecipePage(
        does="knowledge distillation of a Hugging Face causal LM (the student) from a frozen "
        "teacher, with tensor parallelism (docs/distillation.md)",
        regression="distill_llama_tp1",
        data=("default", "hf", "jsonl", "mix"),
    ),
}


def page(
    conf_dir: Path = CONF_DIR,
    script: str = "finetune.py",
    name: str = "config",
    schema: type[Config] = Config,
) -> str:
    """The whole ``--help`` page of the recipe ``script``, whose primary config is
    ``conf/<name>.yaml`` (``conf/config.yaml``, or one that composes it and overrides groups) and
    whose schema is ``schema``."""
    config = yaml.safe_load((conf_dir / "config.yaml").read_text())
    own = yaml.safe_load((conf_dir / f"{name}.yaml").read_text()) if name != "config" else {}
    for entry in own.get("defaults", []):  # `override data: preference`: the recipe's default
        if isinstance(entry, dict):
            config["defaults"] += [{k.removeprefix("override "): v for k, v in entry.items()}]
    recipe = PAGES[script]
    own = own_experiments(conf_dir / "experiment", script)
    keys = [(key, recipe.sets.get(key, sets)) for key, sets in common_keys(schema)]
    unread = (*recipe.unread, *schema.DEGREES_AT_ONE)  # the degrees it runs at 1 only too
    keys = [(key, sets) for key, sets in keys if key not in unread]
    width = max(len(name) for name, _ in keys)
    example = f"experiment=regression/{recipe.regression}"
    lines = [f"shardtune: {recipe.does}.", f"Regression recipes: experiment=regression/NAME "
             f"(e.g. {example}).", USAGE.format(script=script), ""]  # fmt: skip
    groups = group_lines(conf_dir, config, {"data": recipe.data, **own})
    lines += ["Groups (GROUP=OPTION; * marks the default):", *groups, ""]
    lines += ["Keys most runs touch (KEY=VALUE; types and ranges: recipes/schema.py):"]
    lines += [f"  {name:<{width}}  {sets}" for name, sets in keys]
    return "\n".join([*lines, "", FLAGS])


def experiment_recipe(name: str) -> str:
    """The recipe an experiment (``conf/experiment/NAME.yaml``, a regression one too) is an example
    of, by its name: ``dpo_*``, ``dpo.py``; ``distill_*``, ``distill.py``; any other,
    ``finetune.py``."""
    script = f"{name.split('_')[0]}.py"
    return script if script in PAGES else "finetune.py"


def own_experiments(folder: Path, script: str) -> dict[str, tuple[str, ...]]:
    """The experiments of ``folder`` (``conf/experiment/``) and of each of its subfolders that are
    examples of ``script`` (:func:`experiment_recipe`), by ``group_lines``' folder names."""
    found = {}
    for where in [folder, *sorted(path for path in folder.iterdir() if path.is_dir())]:
        names = [path.stem for path in sorted(where.glob("*.yaml"))]
        group = where.relative_to(folder.parent).as_posix()
        found[group] = tuple(name for name in names if experiment_recipe(name) == script)
    return found


def common_keys(section: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, what it sets) of each key of ``section`` and its subsections declared with
    ``common=``, in declaration order."""
    found = []
    for name, declared in section.model_fields.items():
        dotted = f"{prefix}{declared.alias or name}"
        if isinstance(declared.annotation, type) and issubclass(declared.annotation, BaseModel):
            found += common_keys(declared.annotation, f"{dotted}.")
        elif isinstance(declared.json_schema_extra, dict) and COMMON in declared.json_schema_extra:
            found.append((dotted, declared.json_schema_extra[COMMON]))
    return found


def group_lines(
    conf_dir: Path, config: dict, read: dict[str, tuple[str, ...]] | None = None
) -> list[str]:
    """One line per folder of ``conf_dir``: its options (of a group in ``read``, the ones the
    recipe reads), the default marked; a subfolder's files (of one in ``read`` as
    ``group/subfolder``, the ones read) as ``subfolder/NAME`` with their count, if any."""
    read = read or {}
    chosen = {}
    for entry in config["defaults"]:
        if isinstance(entry, dict):
            chosen |= entry
    lines = []
    for folder in sorted(path for path in conf_dir.iterdir() if path.is_dir()):
        options = [path.stem for path in sorted(folder.glob("*.yaml"))]
        options = [name for name in options if name in read.get(folder.name, options)]
        names = [name + ("*" if name == chosen.get(folder.name) else "") for name in options]
        for nested in sorted(path for path in folder.iterdir() if path.is_dir()):
            files = [path.stem for path in nested.glob("*.yaml")]
            count = len(read.get(f"{folder.name}/{nested.name}", files))
            names += [f"{nested.name}/NAME ({count})"] if count else []
        lines.append(f"  {folder.name + '=':<12}{', '.join(names)}")
    return lines
