"""Export a (tensor- or data-parallel) model as a Hugging Face folder that ``from_pretrained`` loads.

The full state dict is gathered to rank 0 on the CPU (``full_state_dict`` + ``cpu_offload``: the other ranks
hold nothing), then rank 0 writes safetensors (sharded with an index above ``max_shard_size``), config.json
and the tokenizer into ``<out_dir>.tmp`` and renames it to ``out_dir``, so a half-written export is never
mistaken for a model. Tensors keep the model's own names and dtype.
"""

import copy
import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PretrainedConfig, PreTrainedModel

from components.training.checkpoint import publish_folder, run_on_rank0

INDEX_FILE = "model.safetensors.index.json"


def _tied_duplicates(model: nn.Module) -> set[str]:
    """Names of parameters that are the same object as an earlier one (``lm_head.weight`` when tied).

    Hugging Face checkpoints store a tied pair once, under the first name, and re-tie on load.
    """
    first: dict[int, str] = {}
    duplicates = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            duplicates.add(name)
    return duplicates


def _architecture(model: nn.Module) -> str | None:
    """The Hugging Face class name of ``model``, also when FSDP2 has swapped in a subclass of it."""
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and cls.__module__.startswith("transformers."):
            return cls.__name__
    return None


def _write_folder(
    state: dict[str, torch.Tensor], config: PretrainedConfig, folder: Path, tokenizer, max_shard_size: str
) -> None:
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name].contiguous() for name in names}, folder / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def export_hf(
    model: nn.Module, config: PretrainedConfig, out_dir: Path, tokenizer=None, max_shard_size: str = "5GB"
) -> Path:
    """Write ``model``'s full weights, ``config`` and ``tokenizer`` (anything with ``save_pretrained``) as a
    Hugging Face folder at ``out_dir``; return it.

    Collective when a process group exists (every rank calls it; only rank 0 writes); a plain model in a
    single process needs none. Tied parameters are written once under their first name. ``config`` is
    copied, not changed; its ``architectures`` is filled in from the model when missing (vLLM needs it).
    """
    out_dir = Path(out_dir)
    duplicates = _tied_duplicates(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    config = copy.deepcopy(config)
    if not getattr(config, "architectures", None) and (architecture := _architecture(model)):
        config.architectures = [architecture]

    def write() -> None:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        kept = {name: tensor for name, tensor in state.items() if name not in duplicates}
        _write_folder(kept, config, tmp, tokenizer, max_shard_size)
        publish_folder(tmp, out_dir)

    run_on_rank0(write)
    return out_dir
