"""Direct Preference Optimization of a Hugging Face causal LM against a frozen reference, on the
same machinery as fine-tuning: ``python recipes/dpo.py tp=2 dpo.beta=0.1`` (docs/dpo.md).

``main`` is ``finetune.py``'s story with DPO's parts: the config composed from ``conf/dpo.yaml``
(``conf/config.yaml``'s groups and keys plus ``dpo.*``, the embedded preference pairs by default),
checked against ``recipes.dpo_schema.DpoConfig`` (every problem one ``error:`` line before any rank
starts), prepared once (the pairs tokenized into the cache, the output folder claimed, the
checkpoint to resume chosen), then the ranks. What each rank runs (fine-tuning's set up, train and
finish, with the frozen reference and DPO's step) is ``recipes/dpo_rank.py``.
"""

import sys

try:  # recipes.finetune is found in the project's venv only; it checks torch and hydra there
    from recipes import finetune
except ModuleNotFoundError:  # a bare `python`: one line, not a traceback
    print(
        f"error: {sys.executable} has no shardtune installed: run the recipe with the project's "
        "venv, .venv/bin/python recipes/dpo.py ... (after make install)",
        file=sys.stderr,
    )
    sys.exit(2)

DPO = finetune.Recipe.of(
    "dpo",  # conf/dpo.yaml, DpoConfig, recipes/dpo_rank.py; the reference's checks and spec:
    check="recipes.dpo_checks:check_dpo",
    prepare="recipes.dpo_checks:prepare_dpo",
)

if __name__ == "__main__":
    finetune.main(sys.argv[1:], DPO)
