"""Distil a frozen teacher into a student (the ``model``), a Hugging Face causal LM of the same
vocabulary, with every parallel layout of fine-tuning: ``python recipes/distill.py tp=2``.

``main``: ``finetune.py``'s command line over ``conf/distill.yaml`` (the same groups and keys, plus
``teacher.*`` and ``distill.*``); ``run``: fine-tuning's checks against the distillation schema,
then the teacher's (its folder or config, its TP plan, its vocabulary against the student's), each
problem one ``error:`` line before any rank starts; fine-tuning's preparation and the teacher's
spec; then the ranks (``recipes/distill_rank.py``). docs/distillation.md says what each key does.
"""

import sys
from importlib.util import find_spec

if find_spec("components") is None:  # a bare python: one line, as finetune.py says it
    sys.exit(f"error: {sys.executable} has no shardtune installed: use .venv/bin/python")

from omegaconf import DictConfig

from components.runtime.problems import refusals
from components.runtime.startup import keep_cuda_unstarted
from recipes import finetune


def main(arguments: list[str]) -> None:
    """Fine-tuning's command line (``finetune.main``) over ``conf/distill.yaml`` and :func:`run`."""
    finetune.main(arguments, "distill", run)


def run(cfg: DictConfig, job_dir: str | None, hydra_run_dir: str | None) -> None:
    """Check (pure: the student, the layout, the teacher), prepare once, then the ranks."""
    keep_cuda_unstarted()  # before anything imported asks torch.cuda: ranks are forked
    from recipes.distill_checks import check_distillation, prepare_distillation  # (finetune.py)
    from recipes.distill_rank import rank_main

    with refusals():  # bad input: one error: line per problem, before any rank
        checked = check_distillation(cfg, job_dir, hydra_run_dir)
    finetune.launch(checked, prepare_distillation, rank_main)


if __name__ == "__main__":
    main(sys.argv[1:])
