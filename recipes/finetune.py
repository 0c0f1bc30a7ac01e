"""Fine-tune a Hugging Face causal LM with tensor parallelism (DTensor), configured with Hydra:
``python recipes/finetune.py model=llama tp=4 train.max_steps=5``.

``main``: the config composed from the command line, checked (pure: every problem one ``error:``
line before any rank starts), prepared once (model and data into the cache, the output folder
claimed, the checkpoint to resume chosen), then the dry run or the ranks. What each rank runs (set
up, train, finish) is ``recipes/finetune_rank.py``; the checks and the plan, ``recipes/checks.py``
and ``recipes/prepare.py``; launching, restarts and exit statuses, ``components/runtime``.
"""

from __future__ import annotations  # Checked's module imports torch: named, not imported

import sys
from importlib.util import find_spec

# A bare `python` (not the venv's) would end in a ModuleNotFoundError traceback: one line instead.
if not all(find_spec(name) for name in ("components", "torch", "hydra")):  # found, not imported
    print(
        f"error: {sys.executable} has no shardtune installed: run the recipe with the project's "
        "venv, .venv/bin/python recipes/finetune.py ... (after make install) or make run ARGS=...",
        file=sys.stderr,
    )
    sys.exit(2)

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from components.runtime.cli import (
    Job,
    given_run_dir,
    hydra_command_line,
    hydra_options,
    named,
    prints_only,
    refuse_as_the_recipe,
)
from components.runtime.malloc import exec_with_malloc_settings
from components.runtime.problems import fail, refusals
from components.runtime.startup import end_launched_rank, keep_cuda_unstarted, started_by_launcher

if TYPE_CHECKING:
    from recipes.plan import Checked

CONF = Path(__file__).resolve().parents[1] / "conf"


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a recipe of this shape is made of, each named, imported once the command line is
    read: its file (``recipes/<script>``), its primary config (``conf/<config>.yaml``), the
    ``module:function`` composing it from the command line, its schema (a class of
    ``recipes/schema.py``), what each rank runs, and its pure checks and its preparation
    (fine-tuning's, or a recipe's own on theirs: ``distill.py``'s teacher)."""

    script: str
    config: str
    compose: str
    schema: str
    rank_main: str
    check: str = "recipes.checks:check"
    prepare: str = "recipes.prepare:prepare"

    @classmethod
    def of(cls, name: str, **own: str) -> Recipe:
        """The recipe ``recipes/<name>.py`` by the project's names: ``conf/<name>.yaml``,
        ``recipes.compose:compose_<name>``, ``recipes.<name>_schema:<Name>Config`` and
        ``recipes.<name>_rank:rank_main``; ``own``: any part of its own instead (its checks)."""
        names = dict(script=f"{name}.py", config=name, compose=f"recipes.compose:compose_{name}")
        names |= dict(schema=f"recipes.{name}_schema:{name.capitalize()}Config")
        return cls(**names, rank_main=f"recipes.{name}_rank:rank_main", **own)


FINETUNE = Recipe(
    script="finetune.py",
    config="config",
    compose="recipes.compose:compose",
    schema="recipes.schema:Config",
    rank_main="recipes.finetune_rank:rank_main",
)


def main(arguments: list[str], recipe: Recipe = FINETUNE, job: Job | None = None) -> None:
    """Compose, then run; ``--help`` is the recipe's own page; Hydra's own options (``--cfg job``,
    ``--multirun``, ``--hydra-help``) go to Hydra, which runs each job of a sweep in its own
    folder (``job``: :func:`run` of ``recipe``), once overrides that do not compose are refused as
    the recipe refuses them."""
    job = job or recipe_job(recipe)
    if not prints_only(arguments):
        exec_with_malloc_settings()  # before torch: the ranks it forks keep this malloc
    if "--help" in arguments or "-h" in arguments:
        from recipes.help import page  # the schema, for --help alone (design-notes.md, imports)

        print(page(script=recipe.script, name=recipe.config, schema=named(recipe.schema)))
    elif hydra_options(arguments):
        refuse_as_the_recipe(CONF, arguments, recipe.compose, recipe.config)  # a misspelt key
        hydra_command_line(CONF, job, recipe.config)
    else:
        compose = named(recipe.compose)  # once the line is read: design-notes.md, imports
        cfg = compose(arguments)
        job(cfg, job_dir=None, hydra_run_dir=given_run_dir(arguments, cfg))
    if started_by_launcher():
        end_launched_rank()  # under torchrun: as a forked local rank ends


def recipe_job(recipe: Recipe) -> Job:
    """:func:`run` of ``recipe``, as Hydra calls a job (fine-tuning's: :func:`run` itself)."""
    if recipe == FINETUNE:
        return run

    def run_recipe(cfg: DictConfig, job_dir: str | None, hydra_run_dir: str | None) -> None:
        run(cfg, job_dir, hydra_run_dir, recipe)

    return run_recipe


def run(
    cfg: DictConfig, job_dir: str | None, hydra_run_dir: str | None, recipe: Recipe = FINETUNE
) -> None:
    """Check (pure), prepare once, then the dry run or the ranks. ``job_dir``: a sweep job's own
    folder; ``hydra_run_dir``: checked to agree with output_dir."""
    keep_cuda_unstarted()  # before anything imported asks torch.cuda (torchao): ranks are forked
    check = named(recipe.check)  # (see main)

    with refusals():  # bad input: one error: line; Ctrl-C: one line
        checked = check(cfg, job_dir, hydra_run_dir, named(recipe.schema))
    launch(checked, recipe)


def launch(checked: Checked, recipe: Recipe = FINETUNE) -> None:
    """Prepare once (here, or on rank 0 of a torchrun world, whose plan every rank receives), then
    the dry run (the layout priced on fake ranks) or the ranks; the output folder's lock is
    released once they are done."""
    from components.planning.dry_run import UnbuildableLayout, dry_run  # (after the checks)
    from components.runtime import ranks

    prepare, rank_main = named(recipe.prepare), named(recipe.rank_main)

    ranks.join_launched_world(checked)
    plan, lock = None, None
    with refusals(), ranks.failure_told_to_waiting_ranks():
        if ranks.prepares_here():
            plan, lock = prepare(checked)
    plan = ranks.shared_plan(plan)
    try:
        if plan.dry_run:
            try:
                dry_run(plan)
            except UnbuildableLayout as error:
                fail(str(error))
        else:
            settings, world_size = plan.settings, plan.dims.world_size
            ranks.run_ranks(
                rank_main, plan, world_size, settings.max_restarts, settings.hang_timeout_s
            )
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main(sys.argv[1:])
