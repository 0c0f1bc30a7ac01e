"""Check a Hugging Face model folder before any rank loads it: weights present, readable and shaped for the model,
and a tokenizer that loads. Reads only safetensors headers (no tensor data) and never unpickles anything."""

from pathlib import Path

from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (``model.safetensors`` or the shards of any ``*.safetensors``)."""
    return sorted(Path(folder).glob("*.safetensors"))


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118


def check_model_folder(folder: Path, model: nn.Module) -> list[str]:
    """Why the weights in ``folder`` cannot be loaded into ``model`` (a meta-device build of its config), each
    problem one phrase naming the folder and the file; empty when they can."""
    files = weight_files(folder)
    if not files:
        pickled = sorted(path.name for path in Path(folder).glob("*.bin"))
        why = f"only pickled weights ({', '.join(pickled)}), which can run code" if pickled else "no weights"
        return [f"model folder {folder} has {why}: it needs *.safetensors files"]
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    errors = []
    for path in files:
        try:
            shapes = _header_shapes(path)
        except Exception as error:  # noqa: BLE001 - a damaged file raises any of several errors
            errors.append(f"{path} cannot be read ({str(error).splitlines()[0]}): it is truncated or not safetensors")
            continue
        wrong = [f"{name} {list(shape)} (the model wants {list(expected[name])})" for name, shape in shapes.items()
                 if name in expected and expected[name] != shape]  # fmt: skip
        if wrong:
            errors.append(f"{path} holds tensors of another shape: {'; '.join(wrong[:3])}")
    return errors


def check_tokenizer_folder(folder: Path) -> list[str]:
    """Why the tokenizer of ``folder`` cannot be loaded (one phrase), or nothing."""
    try:
        AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # noqa: BLE001 - missing files raise OSError, ValueError or TypeError
        return [f"model folder {folder} has no tokenizer that loads ({str(error).splitlines()[0][:160]})"]
    return []
