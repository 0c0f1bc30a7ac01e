"""The end of a run: the trained model exported, as ``hf/`` (a Hugging Face folder), or with
``peft=lora`` as ``adapter/`` (PEFT's format) and, with ``peft.merge=true``, ``hf/`` merged."""

import torch
from transformers import AutoTokenizer

from components.checkpoint.export import export_dtype, export_hf
from components.checkpoint.peft_export import adapter_config, export_peft_adapter
from components.distributed.pipeline import every_stage
from components.models.lora import adapted_parameters, adapter_state, lora_modules, merge_adapters
from recipes.plan import RunPlan


def export(model: torch.nn.Module, plan: RunPlan, stages=None) -> None:
    """``hf/``: the trained model as a Hugging Face folder; with ``peft=lora`` ``adapter/`` in
    PEFT's format instead, and with ``peft.merge=true`` ``hf/`` of the merged model too.
    ``stages``: the ``pp`` group's process group (None without pipeline stages), whose ranks hold
    the other stages' adapters."""
    source, base, peft = plan.model.weights, plan.settings.model.pretrained_path, plan.settings.peft
    dtype = export_dtype(plan.checkpoint.export_dtype, source)
    if (lora := plan.lora) is not None:
        names = [name for name, _ in lora_modules(model)]
        experts, state = adapted_parameters(model), adapter_state(model, dtype)
        if stages is not None:  # every stage's adapters, for rank 0 to write
            names, experts, state = every_stage((names, experts, state), stages)
        config = adapter_config(lora.rank, lora.alpha, lora.dropout, names, base, experts)
        export_peft_adapter(state, config, plan.output_dir / "adapter")
        if not peft.merge:
            return
        merge_adapters(model)  # the same function, its adapters folded into the base
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_dir, trust_remote_code=False)
    card = dict(recipe="recipes/finetune.py", config_yaml=plan.config_yaml, base_model=base)
    files = dict(tokenizer=tokenizer, dtype=dtype, source_dir=source)
    export_hf(model, plan.model.config, plan.output_dir / "hf", **files, **card)


def export_folders(plan: RunPlan) -> tuple[str, ...]:
    """What :func:`export` writes, as the done line names it."""
    if plan.lora is None:
        return ("hf/",)
    return ("adapter/", "hf/") if plan.settings.peft.merge else ("adapter/",)
