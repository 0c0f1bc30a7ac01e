"""Distil a frozen teacher into a student (the ``model``), Hugging Face causal LMs of one
vocabulary, on the same machinery as fine-tuning: ``python recipes/distill.py tp=2``
(docs/distillation.md).

``main`` is ``finetune.py``'s story with distillation's parts: the config composed from
``conf/distill.yaml`` (``conf/config.yaml``'s groups and keys plus ``teacher.*`` and ``distill.*``),
checked against ``recipes.distill_schema.DistillConfig`` and then the teacher as a model of its own
(``recipes/distill_checks.py``: its folder or config, its TP plan, its vocabulary against the
student's), every problem one ``error:`` line before any rank starts; prepared once as fine-tuning
is, with the teacher's spec; then the ranks. What each rank runs (fine-tuning's set up, train and
finish, with the frozen teacher and distillation's step) is ``recipes/distill_rank.py``.
"""

import sys

try:  # recipes.finetune is found in the project's venv only; it checks torch and hydra there
    from recipes import finetune
except ModuleNotFoundError:  # a bare `python`: one line, not a traceback
    sys.exit(f"error: {sys.executable} has no shardtune installed: use .venv/bin/python")

DISTILL = finetune.Recipe.of(
    "distill",  # conf/distill.yaml, DistillConfig, recipes/distill_rank.py; the teacher's checks:
    check="recipes.distill_checks:check_distillation",
    prepare="recipes.distill_checks:prepare_distillation",
)

if __name__ == "__main__":
    finetune.main(sys.argv[1:], DISTILL)
