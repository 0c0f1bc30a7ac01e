"""Check a Hugging Face model folder before any rank loads it: weights present, readable and shaped
for the model, and a tokenizer that loads. Reads only safetensors headers (no tensor data) and never
unpickles anything.

Nothing in a folder is ever run: :func:`custom_code_errors` refuses, before transformers reads the
folder, a config or tokenizer that would need the folder's own ``.py`` files (an ``auto_map``, or a
``model_type`` transformers does not know); every ``from_pretrained`` passes
``trust_remote_code=False``."""

import json
from pathlib import Path

from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from components.models.checkpoint import (
    Checkpoint,
    StoredLayout,
    UnsupportedLayout,
    index_errors,
)

# The files through which transformers would import the folder's code (each may hold an auto_map).
CODE_BEARING_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def custom_code_errors(folder: Path) -> list[str]:
    """Why ``folder`` would need code of its own to load (one phrase per file, naming it), or
    nothing. Reads the JSON files only: nothing is imported from the folder."""
    errors = []
    for name in CODE_BEARING_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            errors.append(f"{path} is not valid JSON ({str(error).splitlines()[0][:120]})")
            continue
        if not isinstance(content, dict):
            errors.append(f"{path} is not a JSON object")
            continue
        if "auto_map" in content:
            targets = ", ".join(sorted(set(_code_references(content["auto_map"]))))
            errors.append(
                f"{path} has an auto_map ({targets[:160]}): it would run the folder's own "
                "Python code, which shardtune never does; use a model whose model_type "
                "transformers knows, without auto_map"
            )
        model_type = content.get("model_type")
        if name == "config.json" and model_type not in CONFIG_MAPPING_NAMES:
            errors.append(
                f"{path} has model_type={model_type!r}, which transformers does not know: it would "
                "need the folder's own code, which shardtune never runs; use a model transformers "
                "supports"
            )
    return errors


def _code_references(auto_map: object) -> list[str]:
    """The ``module.Class`` strings of an ``auto_map`` (a value: one, a list of them, or null)."""
    if isinstance(auto_map, dict):
        return [name for value in auto_map.values() for name in _code_references(value)]
    if isinstance(auto_map, list):
        return [name for value in auto_map for name in _code_references(value)]
    return [str(auto_map)] if auto_map is not None else []


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (``model.safetensors`` or the shards of any
    ``*.safetensors``)."""
    return sorted(Path(folder).glob("*.safetensors"))


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as handle:
        # noqa: SIM118
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def check_model_folder(folder: Path, model: nn.Module) -> list[str]:
    """Why the weights in ``folder`` cannot be loaded into ``model`` (a meta-device build of its
    config), each problem one phrase naming the folder and the file; empty when they can."""
    if errors := index_errors(folder):
        return errors
    files = weight_files(folder)
    if not files:
        pickled = sorted(path.name for path in Path(folder).glob("*.bin"))
        why = (
            f"only pickled weights ({', '.join(pickled)}), which can run code"
            if pickled
            else "no weights"
        )
        return [f"model folder {folder} has {why}: it needs *.safetensors files"]
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    errors = []
    for path in files:
        try:
            shapes = _header_shapes(path)
        except Exception as error:  # noqa: BLE001 - a damaged file raises any of several errors
            errors.append(
                f"{path} cannot be read ({str(error).splitlines()[0]}): it is truncated or not "
                "safetensors"
            )
            continue
        wrong = [
            f"{name} {list(shape)} (the model wants {list(expected[name])})"
            for name, shape in shapes.items()
            if name in expected and expected[name] != shape
        ]
        if wrong:
            errors.append(f"{path} holds tensors of another shape: {'; '.join(wrong[:3])}")
    return errors or missing_tensor_errors(folder, model)


def missing_tensor_errors(folder: Path, model: nn.Module) -> list[str]:
    """The model's tensors ``folder`` does not hold (as the loader looks for them: through
    transformers' conversion rules for the model, or as a tied partner), named in one phrase, and
    those stored in a layout the loader cannot read (the first, in its own phrase); nothing when
    all are there. An untied ``lm_head.weight`` must be stored: it is not the embedding."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    tied = {**ties, **{source: target for target, source in ties.items()}}
    missing, unsupported = [], []
    with Checkpoint(folder) as checkpoint:
        layout = StoredLayout(checkpoint, model)
        for name in model.state_dict():
            try:
                layout.source(name, tied)
            except KeyError:
                missing.append(name)
            except UnsupportedLayout as error:
                unsupported.append(str(error))
    if unsupported:
        return [f"model folder {folder}: {unsupported[0]}"]
    if not missing:
        return []
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    untied = "lm_head.weight" in missing and not getattr(model.config, "tie_word_embeddings", True)
    why = " (config.json has tie_word_embeddings=false: the head is a tensor of its own)"
    return [
        f"model folder {folder} lacks {', '.join(missing[:3])}{more}{why if untied else ''}: its "
        "weights are not a checkpoint of the model its config.json describes"
    ]


def check_tokenizer_folder(folder: Path, embedding_rows: int | None = None) -> list[str]:
    """Why the tokenizer of ``folder`` cannot be loaded, or (given the model's ``embedding_rows``)
    cannot feed the model: a token id at or past the embedding's last row would fail inside every
    rank's first forward. One phrase, or nothing."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    # noqa: BLE001 - missing files raise OSError, ValueError or TypeError
    except Exception as error:
        return [
            f"model folder {folder} has no tokenizer that loads "
            f"({str(error).splitlines()[0][:160]})"
        ]
    ids = max([len(tokenizer) - 1, *tokenizer.get_vocab().values()]) + 1
    if embedding_rows is not None and ids > embedding_rows:
        return [
            f"the tokenizer of model folder {folder} has token ids up to {ids - 1}, but the "
            f"model's embedding has {embedding_rows} rows (config.json vocab_size): use the "
            "tokenizer the model was trained with"
        ]
    return []
