"""A tensor-parallel plan for a model that has none, derived from its structure.

The decoder blocks are the items of the model's one ``nn.ModuleList``. In a block, every child
module that holds ``nn.Linear`` children is a sublayer (attention or MLP): its linears that read the
hidden size are split by columns (``colwise``: q/k/v, gate/up; not an MLP's wider than the output's
input, fused and cut after it: ModernBERT's ``Wi``), and its last linear that writes the hidden
size from another width (or, when every linear reads the hidden size, its last one) by rows
(``rowwise``: o_proj, down_proj). Per-head q/k norms (1-D of ``head_dim``) are replicated with
summed gradients, one value per attention head (GPT-OSS's ``sinks``) sharded with the heads
(``colwise`` on the parameter, the sublayer ``local_params``), head counts and width of its own
(``self.num_heads``, ``self.embed_dim``) made local (``local_heads``). An MoE block (3-D
parameters) is left to expert parallelism, its router replicated; the embedding and ``lm_head``
get every plan's styles. Anything else with parameters inside a sublayer cannot be placed.
A block's own linears (OPT's ``fc1``, ``fc2``) are its MLP; types measured to fail with what this
derives (:data:`NOT_DERIVED`) are refused with the reason."""

import fnmatch
import inspect

from torch import nn

from components.distributed.tp_styles import HEAD_COUNTS

# Types whose derived plan splits what their forward then reads whole (measured by
# bench/coverage.py: a traceback at tp=2), with the reason.
_WHOLE_HEADS = "its fused q/k/v projection is laid out in groups a split by rows does not keep"
_IN_PLACE = "it modifies the split embedding's output in place"
NOT_DERIVED = {
    "bloom": "its ALiBi biases are built for every head, not its rank's",
    **dict.fromkeys(("prophetnet", "trocr"), "its attention reshapes to its input's whole width"),
    **dict.fromkeys(("codegen", "falcon", "gpt_bigcode"), _WHOLE_HEADS),
    **dict.fromkeys(("ctrl", "git"), _IN_PLACE),
}


def decoder_layer_list(model: nn.Module, deeper: bool = False) -> tuple[str, nn.ModuleList] | None:
    """(name, list) of the model's decoder layers: its one ``nn.ModuleList`` beside the embeddings,
    or of several (Gemma 3n's AltUp projections beside its layers) the one named ``layers``; with
    ``deeper``, when there is none there, its one outermost list however deep (OPT's
    ``model.decoder.layers``, BioGPT's ``biogpt.layers``). None when not found."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    near = [(n, m) for n, m in lists if "." not in n.removeprefix("model.")]
    if not near and deeper:
        near = [(n, m) for n, m in lists if not any(n.startswith(f"{o}.") for o, _ in lists)]
    if len(near) > 1:
        near = [(n, m) for n, m in near if n.rpartition(".")[2] == "layers"]
    return near[0] if len(near) == 1 else None


def deeper_allowed(config) -> bool:
    """Whether the decoder layers may be looked for deeper than the embeddings: not in a composite
    (image-text) model, whose text model's layers are found by their name only."""
    return config.get_text_config() is config


# Types whose derived plan works at tp > 1 but not under sequence parallelism (measured likewise).
NOT_SEQUENCE_PARALLEL = {
    "xglm": "its sinusoidal positions (no parameters, beside the layers) are added whole to the "
    "embedding's sequence shards",
}


def _blocks(model: nn.Module, deeper: bool = False) -> tuple[str, nn.Module] | None:
    """(name, the first block) of :func:`decoder_layer_list`."""
    found = decoder_layer_list(model, deeper)
    return None if found is None else (found[0], found[1][0])


def _block_mlp(prefix: str, block: nn.Module, hidden: int) -> tuple[dict[str, str], list[str]]:
    """(plan entries, unplaced) of the linears that are the block's own children: an MLP without a
    module of its own (OPT's and XGLM's ``fc1``, ``fc2``), split as one: the linears reading the
    hidden size into the width the one writer reads, colwise, that writer rowwise."""
    linears = [(n, m) for n, m in block.named_children() if isinstance(m, nn.Linear)]
    writers = [(n, m) for n, m in linears if m.out_features == hidden and m.in_features != hidden]
    if len(writers) == 1:
        width = writers[0][1].in_features
        readers = [n for n, m in linears if m.in_features == hidden and m.out_features == width]
        if readers and len(readers) + 1 == len(linears):
            return {f"{prefix}.{n}": "colwise" for n in readers} | {
                f"{prefix}.{writers[0][0]}": "rowwise"
            }, []
    return {}, [f"{prefix}.{n}" for n, _ in linears]


def _sublayer(prefix: str, module: nn.Module, hidden: int, head_dim: int | None, heads=None):
    """(plan entries, modules it cannot place) of one attention or MLP sublayer; ``heads``: the
    number of attention heads, which a parameter of one value per head is sharded with."""
    linears = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Linear)]
    writers = [n for n, m in linears if m.out_features == hidden and m.in_features != hidden]
    readers = [n for n, m in linears if m.in_features == hidden]
    output = writers[-1] if writers else (readers[-1] if len(readers) > 1 else None)
    plan, unplaced = {}, []
    heads_of_its_own = any(isinstance(getattr(module, c, None), int) for c in HEAD_COUNTS)
    # an MLP's reader wider than the output's input is fused and cut after it (attention's fused
    # q/k/v, such as Persimmon's, holds each head's q, k and v together: split by heads)
    width = dict(linears)[output].in_features if output and not heads_of_its_own else None
    for name, child in module.named_children():
        pattern = f"{prefix}.{name}"
        if name == output:
            plan[pattern] = "rowwise"
        elif name in readers and width is not None and child.out_features > width:
            unplaced.append(f"{pattern} (wider than {output}'s input: fused, cut after it)")
        elif name in readers:
            plan[pattern] = "colwise"
        elif _is_head_norm(child, head_dim):
            plan[pattern] = "replicated_with_grad_allreduce"
        elif any(True for _ in child.parameters()):
            unplaced.append(pattern)
    for name, parameter in module.named_parameters(recurse=False):
        if heads is not None and parameter.shape == (heads,):  # one per head: attention sinks
            plan[f"{prefix}.{name}"], plan[prefix] = "colwise", "local_params"
        else:
            unplaced.append(f"{prefix} (its parameter {name})")
    if heads_of_its_own:
        if plan.get(prefix) == "local_params":
            unplaced.append(f"{prefix} (head counts of its own and per-head parameters)")
        plan[prefix] = "local_heads"
    if output is None:
        unplaced.append(f"{prefix} (no output projection to the hidden size)")
    return plan, unplaced


def _is_head_norm(module: nn.Module, head_dim: int | None) -> bool:
    parameters = list(module.parameters())
    return bool(parameters) and all(p.shape == (head_dim,) for p in parameters)


def derive_plan(model: nn.Module, config) -> dict[str, str]:
    """The plan for ``model`` (a meta-device build is enough), as ``plan_for`` returns one.

    Raises:
        ValueError: naming every module the derivation cannot place.
    """
    text = config.get_text_config()  # an image-text model's decoder is its text model's
    hidden = getattr(text, "hidden_size", None)  # BLT's: one per sub-model, none of its own
    heads = getattr(text, "num_attention_heads", None)
    what = f"model type {config.model_type!r} has no tensor-parallel plan"
    if config.model_type in NOT_DERIVED:
        raise ValueError(
            f"{what}, and one derived from its structure does not train what tp=1 trains: "
            f"{NOT_DERIVED[config.model_type]}; use tp=1"
        )
    found = _blocks(model, deeper=deeper_allowed(config))
    if found is None:
        raise ValueError(f"{what}, and its decoder layers (one nn.ModuleList) were not found")
    if hidden is None:
        raise ValueError(f"{what}, and its config has no hidden_size to derive one from")
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else None)
    layers, block = found
    plan: dict[str, str] = {}
    unplaced: list[str] = []
    for name, child in block.named_children():
        prefix = f"{layers}.*.{name}"
        if any(p.dim() == 3 for p in child.parameters()):  # an MoE block: expert parallelism's
            continue
        if isinstance(child, nn.Linear):  # the block's own MLP: _block_mlp
            continue
        if any(isinstance(m, nn.Linear) for m in child.children()):
            entries, missing = _sublayer(prefix, child, hidden, head_dim, heads)
            plan |= entries
            unplaced += missing
        elif any(True for _ in child.parameters()) and not _is_norm(child):  # norms: replicated
            unplaced.append(prefix)
    if any(isinstance(child, nn.Linear) for child in block.children()):
        entries, missing = _block_mlp(f"{layers}.*", block, hidden)
        plan |= entries
        unplaced += missing
    if unplaced:
        raise ValueError(
            f"{what}, and one derived from its structure cannot place {', '.join(unplaced)}: "
            "use tp=1"
        )
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    plan = {embedding: "embedding_rowwise", **plan}
    if model.get_output_embeddings() is not None:
        head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
        plan[head] = "vocab_parallel"
    return plan


def _is_norm(module: nn.Module) -> bool:
    """A module of 1-D parameters only, at least one (a norm's weight and bias)."""
    parameters = list(module.parameters())
    return bool(parameters) and all(p.dim() == 1 for p in parameters)


def derived_plan_note(config, plan: dict[str, str]) -> str:
    """The plan report's line for a derived plan: where it came from and what it shards."""
    sharded = ", ".join(f"{name} {style}" for name, style in plan.items())
    return f"plan derived from the structure of {config.model_type!r} (it has none): {sharded}"


def sequence_parallel_norms(model: nn.Module) -> dict[str, str]:
    """Every norm on the residual stream, found from the structure: each block child made of 1-D
    parameters only (before, between and after the sublayers, however many: Gemma's four, Cohere's
    one; in any block, whatever its kind) and the final norm beside the layers, all
    ``sequence_parallel``; empty when the decoder layers are not found."""
    found = _blocks(model)
    if found is None:
        return {}
    layers, _ = found
    plan = {  # by name, each block's (a pattern's * would also match a norm inside a sublayer)
        f"{layers}.{index}.{name}": _norm_style(child)
        for index, block in model.get_submodule(layers).named_children()  # of every kind of layer
        for name, child in block.named_children()
        if _is_norm(child) and not any(isinstance(m, nn.Linear) for m in child.modules())
    }
    for index, block in model.get_submodule(layers).named_children():  # its own parameters
        if any(True for _ in block.parameters(recurse=False)):
            plan[f"{layers}.{index}"] = "sequence_parallel_parameters"
    parent, _, _ = layers.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if parent and any(True for _ in owner.parameters(recurse=False)):  # Zaya's input scale and bias
        plan[parent] = "sequence_parallel_parameters"
    embedding = model.get_input_embeddings()
    for name, child in owner.named_children():
        if child is not embedding and not isinstance(child, nn.ModuleList) and _is_norm(child):
            plan[f"{parent}.{name}" if parent else name] = _norm_style(child)
    return plan


def _norm_style(module: nn.Module) -> str:
    """``sequence_parallel`` for a norm of one input; a module of 1-D parameters that takes two
    (Zaya's residual scaling of the hidden states and the residual) runs on both sequence shards
    as DTensors, its parameters replicated (``sequence_parallel_parameters``)."""
    required = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return "sequence_parallel" if len(required) <= 1 else "sequence_parallel_parameters"


# Styles whose output goes back to the residual stream as sequence shards under SP.
_TO_SHARDS = ("rowwise", "rowwise_split_input", "rowwise_rep", "all_reduce")


def unplanned_sublayers(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The decoder blocks' sublayers (children with parameters, not norms) that no pattern of
    ``plan`` names, neither them nor anything inside them, or whose entries have no style that
    hands back sequence shards (Qwen3-Next's linear attention, ``colwise_gather_output`` only), by
    name: under sequence parallelism each must gather the sequence (``gather_sequence``) to run
    on whole tokens."""
    found = _blocks(model)
    if found is None:
        return []
    layers = found[0]
    unplanned = []
    for index, block in model.get_submodule(layers).named_children():
        for name, child in block.named_children():
            if _is_norm(child) or not any(True for _ in child.parameters()):
                continue
            prefix = f"{layers}.{index}.{name}"
            names = [prefix, *(f"{prefix}.{inner}" for inner, _ in child.named_modules() if inner)]
            styles = [style for pattern, style in plan.items() if fnmatch.filter(names, pattern)]
            if not any(style in _TO_SHARDS for style in styles):
                unplanned.append(prefix)
    return unplanned


def beside_layers(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """The modules with parameters beside the decoder layers (children of their parent other than
    the layers and the embedding) that no pattern of ``plan`` names: Gemma 3n's per-layer input
    projections, which the model runs on the embedding's output. Under sequence parallelism that
    output is a sequence shard these plain modules cannot take."""
    found = _blocks(model)
    if found is None:
        return []
    parent = found[0].rpartition(".")[0]
    owner = model.get_submodule(parent) if parent else model
    layers, embedding = model.get_submodule(found[0]), model.get_input_embeddings()
    names = []
    for name, child in owner.named_children():
        if child is layers or child is embedding or not any(True for _ in child.parameters()):
            continue
        full = f"{parent}.{name}" if parent else name
        if not any(fnmatch.fnmatch(full, pattern) for pattern in plan):
            names.append(full)
    return names
