"""Write a LoRA adapter in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``
(``peft.PeftModel`` loads it onto the base model). The tensors come whole, under PEFT's
names (``components.models.lora.adapter_state``); rank 0 writes and publishes the folder.

Docs: docs/lora.md
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from components.checkpoint.dcp import publish_folder, run_on_rank0
from components.checkpoint.export import check_export_target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    base_model: str | None,
    target_parameters: list[str] = (),
) -> dict:
    """PEFT's LoraConfig as JSON; ``target_modules``: the adapted modules' exact names (PEFT
    matches a name exactly or by its ending); ``target_parameters``: the MoE expert weights with
    per-expert adapters, by full name (null when none)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "target_parameters": sorted(target_parameters) or None,
    }


def export_peft_adapter(
    state: dict[str, torch.Tensor], config: dict, out_dir: Path, tokenizer=None
) -> Path:
    """Write ``state`` (whole tensors, the same on every rank) and ``config`` as a PEFT adapter
    folder at ``out_dir``, with the run's ``tokenizer`` beside them (as TRL's trainers save it:
    ``AutoTokenizer`` loads the folder too); return it. Collective when a process group exists
    (rank 0 writes).

    Raises:
        ValueError: When ``out_dir`` holds files no export wrote; nothing is changed then.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")

    def write() -> None:
        if problem := check_export_target(out_dir):
            raise ValueError(problem)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crashed export
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        publish_folder(tmp, out_dir)

    run_on_rank0(write)
    return out_dir
