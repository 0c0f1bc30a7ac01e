"""``recipes/dpo.py``'s preparation, on fine-tuning's: then the frozen reference's spec, the
policy's starting weights (``recipes/prepare.py``'s model spec), or none with ``peft=lora`` (the
policy with its adapters off). Imported once the command line is read (``recipes/dpo.py``).
"""

from dataclasses import fields

from components.runtime.output_dir import OutputDirLock
from recipes.plan import Checked, DpoPlan, RunPlan


def prepare_dpo(checked: Checked) -> tuple[DpoPlan, OutputDirLock | None]:
    """Fine-tuning's preparation (tokenizer, data, output folder, checkpoint), then the
    reference's spec: the policy's own (its starting weights), or None with ``peft=lora``."""
    from recipes.prepare import prepare  # datasets, tokenizers: after the checks

    plan, lock = prepare(checked)
    reference = None if plan.lora is not None else plan.model
    base = {field.name: getattr(plan, field.name) for field in fields(RunPlan)}
    return DpoPlan(**base, reference=reference), lock
