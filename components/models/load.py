"""Load a local Hugging Face model folder: its config, and its weights into an (optionally sharded)
model.

``materialize_pretrained`` is the last step of meta-device initialisation: the model was built on
the meta device and a TP (or FSDP-style) plan has already turned parameters into DTensors, so each
rank allocates and reads only its own shard. It runs no collective: every rank computes its slices
from the same checkpoint and model structure, so an error (a missing key, a wrong shape) is raised
on every rank.
"""

import inspect
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from components.models.checkpoint import Checkpoint, StoredLayout, TensorSource
from components.models.folder_check import custom_code_errors
from components.models.lora import is_adapter, reset_adapters


def load_config(pretrained_path: str | Path) -> PretrainedConfig:
    """The config of the local Hugging Face folder ``pretrained_path`` (no Hub, none of its code).

    Raises:
        FileNotFoundError: If the folder or its config.json is missing; the message names the path.
        ValueError: If loading would run code from the folder (an ``auto_map``, an unknown
            ``model_type``); checked before transformers reads the folder, naming the file.
    """
    folder = Path(pretrained_path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    if errors := custom_code_errors(folder):
        raise ValueError("; ".join(errors))
    return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def causal_flags(config: PretrainedConfig, model: nn.Module) -> list[str]:
    """Turn on, in ``config``, the flags without which ``model``'s class (built from it) lets a
    token attend to later ones, and return them: the recipe trains next-token prediction, which
    such attention answers by looking. transformers' BERT-family ``*ForCausalLM`` classes (BERT,
    RoBERTa, XLM-R, X-MOD, ELECTRA...) attend both ways unless ``is_decoder`` (their layers keep
    it; their constructor warns "add ``is_decoder=True``"), XLM's unless ``causal`` (its model
    keeps it). Build the model again from the changed config."""
    modules = list(model.modules())
    flags = []
    if getattr(config, "is_decoder", None) is False and any(
        hasattr(module, "is_decoder") for module in modules
    ):
        flags.append("is_decoder")
    if getattr(config, "causal", None) is False and any(
        getattr(module, "causal", None) is False for module in modules
    ):
        flags.append("causal")
    for flag in flags:
        setattr(config, flag, True)
    return flags


def _takes_position_ids(config: PretrainedConfig) -> bool | None:
    """Whether the causal LM class ``config`` maps to takes ``position_ids`` in its forward (None:
    no class maps to it; it is refused elsewhere)."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        return None
    return "position_ids" in inspect.signature(model_class.forward).parameters


# Model types whose forward a sequence shard cannot run, and why (each a cp refusal).
SEQUENCE_SHARD_REFUSALS = {
    "blt": "its local encoder and decoder cross-attend between bytes and the patches made of them, "
    "which a rank's share of the sequence does not keep",
}


def sequence_problems(config: PretrainedConfig, cp: int, packing: bool) -> list[str]:
    """What this model type cannot run of context parallelism (each rank's tokens are its shard
    of the sequence, at positions of the whole) and packed rows (each example's positions restart,
    which is how its attention is kept inside it), one message each: a type of
    :data:`SEQUENCE_SHARD_REFUSALS` at cp > 1, and a causal LM whose forward takes no
    ``position_ids`` (BART and its kin number their tokens 0, 1, ... themselves; Mamba, RWKV,
    Bloom) at cp > 1 or with packing. A config no causal LM class maps to: none (it is refused
    elsewhere)."""
    kind, found = config.model_type, []
    if cp > 1 and kind in SEQUENCE_SHARD_REFUSALS:
        why = SEQUENCE_SHARD_REFUSALS[kind]
        return [f"cp={cp} with model type '{kind}' is not supported: {why}: use cp=1"]
    if _takes_position_ids(config) in (None, True):
        return []
    if cp > 1:
        found.append(
            f"cp={cp} with model type '{kind}' is not supported: its forward takes no position ids "
            "and numbers a rank's share of the sequence from 0: use cp=1"
        )
    if packing:
        found.append(
            f"train.packing=true with model type '{kind}' is not supported: its forward takes no "
            "position ids, so the examples packed in a row would attend to each other: use "
            "train.packing=false"
        )
    return found


# Model types whose forward lets each token attend to later ones with no config flag that stops it
# (``causal_flags`` turns on the flags of those that have one), and how: next-token prediction
# through such a forward reads the answer, so they are refused.
NOT_CAUSAL = {
    "cpmant": "its forward marks every token as context (CpmAntModel.forward: context = 1), so "
    "each attends to the whole row, later tokens included, and it reads token id 0 as padding on "
    "the left of a row",
}


def causal_problems(config: PretrainedConfig) -> list[str]:
    """A model type of :data:`NOT_CAUSAL`: one message saying what its forward does (measured on
    CPM-Ant: changing a row's last token changes every earlier position's logits)."""
    if (why := NOT_CAUSAL.get(config.model_type)) is None:
        return []
    return [
        f"model type '{config.model_type}' is not a causal LM as transformers runs it: {why}; "
        "next-token training through it would see the tokens it predicts: not supported"
    ]


def position_offset_problems(config: PretrainedConfig) -> list[str]:
    """A causal LM whose embeddings number positions from ``padding_idx + 1`` (RoBERTa's, and
    CamemBERT's, XLM-R's, X-MOD's, Data2Vec-text's: their modeling module's
    ``create_position_ids_from_input_ids``): the recipe passes positions from 0, so every token
    would read the position embedding two rows before its own (measured on CamemBERT: first loss
    5.9313 against its own 5.9573). One message, until the offset is passed (not supported yet)."""
    if not _takes_position_ids(config):
        return []  # none passed (TrOCR numbers its own), or no class maps to it
    modeling = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
    name = "create_position_ids_from_input_ids"  # a function, or a method of its embeddings
    classes = [thing for thing in vars(modeling).values() if isinstance(thing, type)]
    if not any(hasattr(thing, name) for thing in [modeling, *classes]):
        return []
    return [
        f"model type '{config.model_type}' numbers its positions from padding_idx + 1 "
        "(RoBERTa's embeddings), and the recipe passes positions from 0: not supported yet"
    ]


def materialize_pretrained(model: nn.Module, folder: str | Path, device: str = "cpu") -> None:
    """Give ``model`` storage on ``device`` and fill every parameter's rank-local part from the
    checkpoint.

    The model may be on the meta device and its parameters may be DTensors sharded with ``Shard`` or
    ``Replicate`` placements on any mesh; each rank reads only its slice of each tensor. Persistent
    buffers load like parameters; non-persistent ones (rotary ``inv_freq``) are recomputed with the
    model's own ``_init_weights``, as transformers 5 does when it loads a folder.

    Dtypes: each parameter keeps the dtype it was built with (``meta_causal_lm(config, dtype)``),
    whatever the checkpoint's; each slice is read in the stored dtype and converted as it is copied
    into the local shard. A bf16 checkpoint thus gives fp32 master weights under ``bf16-mixed`` with
    no fp32 copy beyond the rank's own shard (and no bf16 copy beyond one slice).

    Tied weights: parameters that were one object before stay one object (``to_empty`` would untie
    them). A tie already broken by parallelisation (embedding and lm_head sharded differently) stays
    broken: each copy is filled from the one stored tensor; keeping the copies in step while
    training is then the caller's concern. LoRA adapters (``components.models.lora``) are not in
    the checkpoint: they get their initial values instead.

    Raises:
        FileNotFoundError: If the folder holds neither model.safetensors nor its index.
        KeyError: If a parameter or persistent buffer is not in the checkpoint; the message names
            it.
        UnsupportedLayout: If one is stored in a form transformers converts in a way this loader
            cannot read (a ``ValueError``; see ``components.models.checkpoint``).
        ValueError: If a stored shape differs from the model's (naming the tensor and both shapes),
            a DTensor has a placement other than Shard or Replicate, or ``_init_weights`` leaves a
            non-persistent floating buffer unset.
    """
    tied = _tied_partners(model)
    with Checkpoint(folder) as checkpoint:
        # Resolve every tensor, and so raise every checkpoint or placement error, before the model
        # is touched.
        layout, sources = StoredLayout(checkpoint, model), {}
        for name, tensor in _loadable_tensors(model):
            if is_adapter(name):  # LoRA's: not in a base checkpoint, drawn below
                continue
            source = layout.source(name, tied)
            stored_shape, model_shape = source.shape(checkpoint), tuple(tensor.shape)
            if stored_shape != model_shape:
                raise ValueError(
                    f"{name}: checkpoint shape {stored_shape} ({source.describe()}) != model "
                    f"shape {model_shape}"
                )
            _check_placements(name, tensor)
            sources[name] = source

        shared = _shared_parameter_names(model)
        model.to_empty(device=device)
        _retie(model, shared)
        _recompute_non_persistent_buffers(model)
        tensors = dict(_loadable_tensors(model))
        with torch.no_grad():
            for name, source in sources.items():
                _fill_local_part(name, tensors[name], source, checkpoint)
        reset_adapters(model)


def _loadable_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each shared one once, under its first name) and persistent buffers, by name."""
    tensors = list(model.named_parameters())
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                tensors.append(
                    (f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer)
                )
    return tensors


def _tied_partners(model: nn.Module) -> dict[str, str]:
    """The model's declared weight ties (transformers' ``all_tied_weights_keys``), in both
    directions."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    return {**ties, **{source: target for target, source in ties.items()}}


def _check_placements(name: str, tensor: torch.Tensor) -> None:
    if isinstance(tensor, DTensor):
        for placement in tensor.placements:
            if not (isinstance(placement, Replicate) or type(placement) is Shard):
                raise ValueError(
                    f"{name}: cannot load into placement {placement!r} (only Shard and Replicate)"
                )


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one parameter object (tied weights)."""
    names_of: dict[nn.Parameter, list[str]] = defaultdict(list)  # tensors hash by identity
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of[parameter].append(name)
    return [names for names in names_of.values() if len(names) > 1]


def _retie(model: nn.Module, shared: list[list[str]]) -> None:
    """Make each group of names one parameter object again (``to_empty`` gives every name its
    own)."""
    for first, *others in shared:
        parameter = model.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, parameter)


def _recompute_non_persistent_buffers(model: nn.Module) -> None:
    """Refill buffers that are not in the checkpoint (garbage after ``to_empty``) with
    ``_init_weights``.

    That is where transformers 5 computes them (rotary ``inv_freq`` and ``original_inv_freq`` from
    the config). This runs before the parameters are loaded, so an owner module's parameters that
    ``_init_weights`` also re-initialises are overwritten by the checkpoint afterwards. Floating
    buffers are first set to NaN, so one that ``_init_weights`` leaves alone is an error instead of
    silent garbage.
    """
    owners = [
        (module_name, module)
        for module_name, module in model.named_modules()
        if any(module._buffers.get(name) is not None for name in module._non_persistent_buffers_set)
    ]
    if not owners:
        return
    init_weights = getattr(model, "_init_weights", None)
    if init_weights is None:
        raise ValueError(
            f"cannot recompute the non-persistent buffers of {owners[0][0]}: no _init_weights"
        )
    with torch.no_grad():
        for module_name, module in owners:
            for name in module._non_persistent_buffers_set:
                if (buffer := module._buffers.get(name)) is not None and buffer.is_floating_point():
                    buffer.fill_(float("nan"))
            _nearest_init_weights(model, module_name, init_weights)(module)
        # Some are set by an ancestor's (Falcon-H1's model sets each Mamba mixer's mup_vector).
        for ancestor in sorted({a for name, _ in _unset(owners) for a in _parents(name)}, key=len):
            _nearest_init_weights(model, ancestor, init_weights)(model.get_submodule(ancestor))
    if unset := _unset(owners):
        raise ValueError(f"{unset[0][0]} is not in the checkpoint and _init_weights did not set it")


def _unset(owners: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """(name, owner) of each floating non-persistent buffer of ``owners`` still NaN."""
    return [
        (f"{module_name}.{name}", module)
        for module_name, module in owners
        for name in sorted(module._non_persistent_buffers_set)
        if (buffer := module._buffers.get(name)) is not None
        and buffer.is_floating_point()
        and buffer.isnan().any()
    ]


def _parents(name: str) -> list[str]:
    """The modules above the buffer ``name`` (not its owner), outermost last: ``a.b.c.buf`` ->
    ``a.b``, ``a``."""
    parts = name.split(".")[:-2]
    return [".".join(parts[:end]) for end in range(len(parts), 0, -1)]


def _fill_local_part(
    name: str, tensor: torch.Tensor, source: TensorSource, checkpoint: Checkpoint
) -> None:
    """Copy this rank's box of the stored tensor into ``tensor``'s local storage."""
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return  # this rank is outside the tensor's mesh and holds nothing
        local = tensor.to_local()
        size, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        if tuple(local.shape) != tuple(size):
            raise ValueError(
                f"{name}: local shard shape {tuple(local.shape)} != computed {tuple(size)}"
            )
    else:
        local, size, offset = tensor, tuple(tensor.shape), (0,) * tensor.dim()
    if local.numel() > 0 and not source.read_into(checkpoint, tuple(offset), local):
        # Else the slice is read, then copied (and converted): one slice held meanwhile.
        local.copy_(source.read(checkpoint, tuple(offset), tuple(size)))


def _nearest_init_weights(model: nn.Module, module_name: str, default):
    """The ``_init_weights`` of the innermost pretrained model holding ``module_name``, as
    transformers' own initialisation calls it (Gemma 3n's text model reads its own
    ``hidden_size``, which the causal LM around it lacks)."""
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), 0, -1):
        holder = model.get_submodule(".".join(parts[:end]))
        if isinstance(holder, PreTrainedModel):
            return holder._init_weights
    return default
