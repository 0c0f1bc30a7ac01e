"""Export a (tensor- or data-parallel) model as a Hugging Face folder that ``from_pretrained`` loads.

The full state dict is gathered to rank 0 on the CPU (``full_state_dict`` + ``cpu_offload``: the other ranks
hold nothing), then rank 0 writes into ``<out_dir>.tmp``:

- safetensors (sharded with an index above ``max_shard_size``) in the requested ``dtype`` (default: the source
  folder's, from its config.json; fp32 for a model built from its config), floating tensors only cast;
- ``config.json`` (its ``dtype`` set to the export's) and the tokenizer, when one is given;
- every metadata file of the source model folder, byte-identical (``generation_config.json``, chat templates,
  tokenizer files, licences: every top-level file that is neither weights, ``config.json`` nor ``README.md``);
  a source file wins over a tokenizer file of the same name;
- ``README.md``, a short model card naming the recipe, the base model and the config the run was made with.

``publish_folder`` then adds the manifest of the files written (``components.runtime.output_dir``) and
renames the folder to ``out_dir`` (the old one is moved aside first), so a half-written export is never
mistaken for a model. An existing ``out_dir`` is only replaced when every file in it is one an earlier export
wrote: a folder holding anything else (a user's own files) is refused with a ValueError, untouched.
"""

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PretrainedConfig, PreTrainedModel

from components.checkpoint.dcp import publish_folder, run_on_rank0
from components.models.hub import looks_like_hub_id
from components.runtime.output_dir import foreign_files

INDEX_FILE = "model.safetensors.index.json"
CARD = "README.md"
# Files of a source model folder that the export writes itself or that hold weights: never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_COPIED = ("config.json", CARD)
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def source_dtype(source_dir: Path | None) -> torch.dtype:
    """The dtype of the weights in the Hugging Face folder ``source_dir`` (``dtype``, or the older
    ``torch_dtype``, in its config.json); float32 when there is no folder or it names none."""
    if source_dir is None:
        return torch.float32
    config = json.loads((Path(source_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_dtype(name: str | None, source_dir: Path | None) -> torch.dtype:
    """The dtype an export writes: ``name`` (``float32``, ``bfloat16`` or ``float16``), or for None the
    source folder's (:func:`source_dtype`).

    Raises:
        ValueError: One line naming the accepted values, for any other name.
    """
    if name is None:
        return source_dtype(source_dir)
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r} is not one of null (the source's), {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def metadata_files(source_dir: Path) -> list[Path]:
    """The top-level files of ``source_dir`` an export copies: all but weights, index files, config.json,
    README.md and hidden files. Symbolic links (a Hub cache snapshot) count as the files they point to."""
    kept = []
    for path in sorted(Path(source_dir).iterdir()):
        name = path.name
        weights = name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
        if path.is_file() and not weights and name not in _NOT_COPIED and not name.startswith("."):
            kept.append(path)
    return kept


def check_export_target(out_dir: Path) -> str | None:
    """Why ``out_dir`` may not receive an export (it holds files no earlier export wrote), or None."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return f"export folder {out_dir} exists and is not a folder; move it away or choose another output_dir"
    foreign = foreign_files(out_dir)
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (
        f"export folder {out_dir} holds files shardtune did not write ({shown}); "
        "move them away or choose another output_dir"
    )


def model_card(recipe: str | None, config_yaml: str | None, base_model: str | None, dtype: torch.dtype) -> str:
    """A short README.md: Hub metadata, where the model came from, and the config it was trained with."""
    front = ["---", "library_name: transformers", "tags:", "- shardtune"]
    if base_model and looks_like_hub_id(base_model):  # the Hub links a base model by id, not by local path
        front.append(f"base_model: {json.dumps(base_model)}")
    lines = [*front, "---", "", "# Fine-tuned with shardtune", ""]
    lines.append(f"- Recipe: `{recipe}`" if recipe else "- Recipe: not recorded")
    lines.append(f"- Base model: `{base_model}`" if base_model else "- Base model: built from its config (random init)")
    lines.append(f"- Weights: {str(dtype).removeprefix('torch.')} safetensors")
    load = "AutoModelForCausalLM.from_pretrained(<this folder>, trust_remote_code=False)"
    lines += ["", f"Load it with `{load}`.", ""]
    if config_yaml:
        lines += [
            "## Config",
            "",
            "The composed config of the run:",
            "",
            "```yaml",
            config_yaml.rstrip("\n"),
            "```",
            "",
        ]
    return "\n".join(lines)


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Cast every floating tensor of ``state`` to ``dtype`` in place, one at a time (peak: one extra tensor)."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            state[name] = tensor.to(dtype)


def _write_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_size: str) -> None:
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    umask = os.umask(0)
    os.umask(umask)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name].contiguous() for name in names}, folder / filename, metadata={"format": "pt"})
        os.chmod(folder / filename, 0o666 & ~umask)  # safetensors creates its files private (0600)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def _write_folder(folder: Path, state, config, tokenizer, max_shard_size: str, source_dir, card: str) -> None:
    """Everything of one export into the empty ``folder``."""
    _write_weights(state, folder, max_shard_size)
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for path in metadata_files(source_dir) if source_dir is not None else []:
        shutil.copyfile(path, folder / path.name)  # follows links: a Hub cache snapshot holds links to blobs
    (folder / CARD).write_text(card)


def export_hf(
    model: nn.Module,
    config: PretrainedConfig,
    out_dir: Path,
    tokenizer=None,
    max_shard_size: str = "5GB",
    *,
    dtype: torch.dtype | None = None,
    source_dir: Path | None = None,
    recipe: str | None = None,
    config_yaml: str | None = None,
    base_model: str | None = None,
) -> Path:
    """Write ``model``'s full weights as ``dtype``, ``config``, ``tokenizer`` (anything with
    ``save_pretrained``), the metadata files of ``source_dir`` (the Hugging Face folder the model was loaded
    from, or None) and a model card naming ``recipe``, ``base_model`` and ``config_yaml`` (the composed
    config as text) as a Hugging Face folder at ``out_dir``; return it.

    ``dtype`` None means the source's (:func:`source_dtype`). Collective when a process group exists (every
    rank calls it; only rank 0 writes); a plain model in a single process needs none. Tied parameters are
    written once under their first name. ``config`` is copied, not changed; its ``architectures`` is filled
    in from the model when missing (vLLM needs it).

    Raises:
        ValueError: Before any gathering, when ``out_dir`` holds files no export wrote
            (:func:`check_export_target`); nothing is changed then. Rank 0 raises the ValueError, the other
            ranks a RuntimeError quoting it (``run_on_rank0``).
    """
    out_dir = Path(out_dir)
    dtype = dtype if dtype is not None else source_dtype(source_dir)

    def check() -> None:
        if problem := check_export_target(out_dir):
            raise ValueError(problem)

    run_on_rank0(check)
    duplicates = _tied_duplicates(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    config = copy.deepcopy(config)
    config.dtype = dtype
    if not getattr(config, "architectures", None) and (architecture := _architecture(model)):
        config.architectures = [architecture]
    card = model_card(recipe, config_yaml, base_model, dtype)

    def write() -> None:
        check()
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crashed export
        tmp.mkdir(parents=True)
        kept = {name: tensor for name, tensor in state.items() if name not in duplicates}
        _cast(kept, dtype)
        _write_folder(tmp, kept, config, tokenizer, max_shard_size, source_dir, card)
        publish_folder(tmp, out_dir)

    run_on_rank0(write)
    return out_dir
