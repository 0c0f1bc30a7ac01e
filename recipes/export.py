"""The end of a run: the trained model exported, as ``hf/`` (a Hugging Face folder), or with
``peft=lora`` (or ``qlora``) as ``adapter/`` (PEFT's format) and, with ``peft.merge=true``,
``hf/`` merged (QLoRA's: the dequantized base's).

The adapter names its base (``base_model_name_or_path``), so that ``AutoPeftModelForCausalLM``
loads it alone: the pretrained folder or Hub id, or, for a model built from its config (seeded
random weights, frozen under LoRA), those weights written to ``base/``."""

from pathlib import Path

import torch
from transformers import AutoTokenizer

from components.checkpoint.dcp import publish_folder, run_on_rank0
from components.checkpoint.export import export_dtype, export_hf
from components.checkpoint.peft_export import adapter_config, export_peft_adapter
from components.distributed.fsdp import reshard
from components.distributed.pipeline import every_stage
from components.models.build import build_causal_lm, save_pretrained_quietly
from components.models.lora import adapted_parameters, adapter_state, lora_modules, merge_adapters
from components.models.precision import precision_policy
from components.models.qlora import dequantize_base
from recipes.plan import RunPlan
from recipes.schema import Peft


def export(model: torch.nn.Module, plan: RunPlan, stages=None) -> None:
    """``hf/``: the trained model as a Hugging Face folder; with ``peft=lora`` ``adapter/`` in
    PEFT's format instead, and with ``peft.merge=true`` ``hf/`` of the merged model too.
    ``stages``: the ``pp`` group's process group (None without pipeline stages), whose ranks hold
    the other stages' adapters."""
    reshard(model)  # a validation at the last step left FSDP's root gathered
    source, base, peft = plan.model.weights, base_model(plan), plan.settings.peft
    dtype = export_dtype(plan.checkpoint.export_dtype, source)
    tokenizer = AutoTokenizer.from_pretrained(plan.tokenizer_dir, trust_remote_code=False)
    if (lora := plan.lora) is not None:
        base = base or write_base(plan, tokenizer, dtype)
        names = [name for name, _ in lora_modules(model)]
        experts, state = adapted_parameters(model), adapter_state(model, dtype)
        if stages is not None:  # every stage's adapters, for rank 0 to write
            names, experts, state = every_stage((names, experts, state), stages)
        config = adapter_config(lora.rank, lora.alpha, lora.dropout, names, base, experts)
        export_peft_adapter(state, config, plan.output_dir / "adapter", tokenizer)
        if not peft.merge:
            return
        if peft.name == "qlora":  # the NF4 base dequantized into its dtype, to merge into
            dequantize_base(model)
        merge_adapters(model)  # the same function, its adapters folded into the base
    card = dict(recipe=plan.settings.RECIPE, config_yaml=plan.config_yaml, base_model=base)
    files = dict(tokenizer=tokenizer, dtype=dtype, source_dir=source)
    export_hf(model, plan.model.config, plan.output_dir / "hf", **files, **card)


def base_model(plan: RunPlan) -> str | None:
    """The adapter's base: ``model.pretrained_path`` (a folder made absolute, a Hub id as given),
    else the folder its weights came from (SmolLM2's conversion in the cache); None for a model
    built from its config."""
    given = plan.settings.model.pretrained_path
    if given is not None:
        folder = Path(given).expanduser()
        return str(folder.absolute()) if folder.is_dir() else given
    return str(plan.model.weights) if plan.model.weights is not None else None


def write_base(plan: RunPlan, tokenizer, dtype: torch.dtype) -> str:
    """``base/``: the frozen base of a model built from its config (the seeded weights every rank
    built, in the run's parameter dtype, saved in ``dtype``) with the tokenizer; its absolute path.
    Collective: rank 0 writes, every rank returns once it is published."""
    folder = (plan.output_dir / "base").absolute()
    tmp = folder.with_name("base.tmp")

    def write() -> None:
        param_dtype = precision_policy(plan.model.precision).param_dtype
        model = build_causal_lm(plan.model.config, seed=plan.seed, dtype=param_dtype)
        save_pretrained_quietly(model.to(dtype), tmp)
        tokenizer.save_pretrained(tmp)
        publish_folder(tmp, folder)

    run_on_rank0(write)
    return str(folder)


def exported_folders(peft: Peft) -> tuple[str, ...]:
    """The folders :func:`export` writes for the ``peft`` settings (a written ``base/`` aside)."""
    if not peft.adapters:
        return ("hf",)
    return ("adapter", "hf") if peft.merge else ("adapter",)


def export_folders(plan: RunPlan) -> tuple[str, ...]:
    """What :func:`export` writes, as the done line names it."""
    written = list(exported_folders(plan.settings.peft))
    if plan.lora is not None and base_model(plan) is None:
        written.insert(1, "base")
    return tuple(f"{folder}/" for folder in written)
