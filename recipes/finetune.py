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

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from components.runtime.cli import (
    Job,
    given_run_dir,
    hydra_command_line,
    hydra_options,
    prints_only,
    refuse_as_the_recipe,
)
from components.runtime.malloc import exec_with_malloc_settings
from components.runtime.problems import fail, refusals
from components.runtime.startup import end_launched_rank, keep_cuda_unstarted, started_by_launcher

if TYPE_CHECKING:
    from recipes.plan import Checked, RunPlan

CONF = Path(__file__).resolve().parents[1] / "conf"


def main(arguments: list[str], config_name: str = "config", job: Job | None = None) -> None:
    """Compose ``conf/config_name.yaml`` (another recipe's: ``distill``), then run ``job``
    (default: this recipe's :func:`run`); ``--help`` is the recipe's own page; Hydra's own options
    (``--cfg job``, ``--multirun``, ``--hydra-help``) go to Hydra, which runs each job of a sweep
    in its own folder, once overrides that do not compose are refused as the recipe refuses
    them."""
    job = job or run
    if not prints_only(arguments):
        exec_with_malloc_settings()  # before torch: the ranks it forks keep this malloc
    if "--help" in arguments or "-h" in arguments:
        from recipes.help import page  # the schema, for --help alone (design-notes.md, imports)

        print(page(config_name=config_name))
    elif hydra_options(arguments):
        composer = "recipes.checks:compose"  # a misspelt key: one line
        refuse_as_the_recipe(CONF, arguments, composer, config_name)
        hydra_command_line(CONF, job, config_name)
    else:
        from recipes.checks import compose  # once the line is read: design-notes.md, imports

        cfg = compose(arguments, config_name)
        job(cfg, job_dir=None, hydra_run_dir=given_run_dir(arguments, cfg))
    if started_by_launcher():
        end_launched_rank()  # under torchrun: as a forked local rank ends


def run(cfg: DictConfig, job_dir: str | None, hydra_run_dir: str | None) -> None:
    """Check (pure), prepare once, then the dry run or the ranks. ``job_dir``: a sweep job's own
    folder; ``hydra_run_dir``: checked to agree with output_dir."""
    keep_cuda_unstarted()  # before anything imported asks torch.cuda (torchao): ranks are forked
    from recipes.checks import check  # (see main)

    with refusals():  # bad input: one error: line; Ctrl-C: one line
        checked = check(cfg, job_dir, hydra_run_dir)
    launch(checked)


def launch(
    checked: Checked,
    prepare: Callable[[Checked], tuple] | None = None,
    rank_main: Callable[[RunPlan], str | None] | None = None,
) -> None:
    """Prepare once (here, or on rank 0 of a torchrun world), then the dry run (the layout priced
    on fake ranks) or the ranks; the output folder's lock is released once they are done.
    ``prepare`` and ``rank_main``: another recipe's (default: fine-tuning's)."""
    from components.planning.dry_run import dry_run  # (after the checks: see main)
    from components.runtime.ranks import prepare_once, run_ranks
    from recipes import finetune_rank
    from recipes import prepare as preparation

    prepare = prepare or preparation.prepare
    rank_main = rank_main or finetune_rank.rank_main

    with refusals():
        plan, lock = prepare_once(prepare, checked)
    try:
        if plan.dry_run:
            dry_run(plan, fail)
        else:
            settings, world_size = plan.settings, plan.dims.world_size
            run_ranks(rank_main, plan, world_size, settings.max_restarts, settings.hang_timeout_s)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main(sys.argv[1:])
