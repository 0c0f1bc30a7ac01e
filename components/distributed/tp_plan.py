"""Tensor-parallel styles, and the one function that checks and applies any plan. Plans are data
(``components.models.families.plan_for``): ``fnmatch`` patterns (``*`` for a layer index) of
module (or parameter) names mapped to style names of HF's ``base_model_tp_plan``:

- ``colwise`` / ``rowwise`` (on a parameter: its first / last dimension; fp8: ``float8_tp``),
  ``embedding_rowwise``, ``vocab_parallel`` (ours) / ``colwise_gather_output``: Megatron-style
  pairs and the vocabulary.
- ``sequence_parallel``; ``local_heads`` (ours: head counts made this rank's); ``local_params``
  (sharded parameters seen as this rank's slices; ``all_reduce`` over them: summed outputs).
- ``replicated_with_grad_allreduce`` (gradient ``sum``) / ``replicate`` (``mean``): not sharded.
- HF's ``rowwise_split_input``, ``all_reduce``, ``embedding_colwise``, ``mla_kv_a_proj`` (aliases
  ``colwise_rep``, ``rowwise_rep``); HF's expert styles (``moe_tp_experts``, ``packed_*``,
  ``moe_identity_expert``) are replaced by expert parallelism (``components.moe``).
Everything is checked before any parameter is sharded, and all problems are reported together
(each style in detail: docs/parallelism.md, docs/design-notes.md).
"""

import fnmatch
import re
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from components.distributed.float8_tp import float8_style
from components.distributed.tp_replicas import (
    mark_tp_replica_gradient_reduction,
    tp_replica_reduction,
)

_VOCAB_STYLES = ("embedding_rowwise", "vocab_parallel", "colwise_gather_output")


class _GatherSequence(ParallelStyle):
    """A sublayer that needs whole tokens (an MoE block, or one the plan leaves replicated) inside a
    sequence-parallel model: every DTensor among its inputs, positional or keyword, is gathered
    into a plain replicated tensor; its output (a tuple's first item) goes back as sequence shards.
    Plan entries inside it take their styles without sequence parallelism."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_gather_inputs, with_kwargs=True)
        module.register_forward_hook(partial(_shard_output, device_mesh))
        return module


def _whole(value):
    if isinstance(value, DTensor):
        return value.redistribute(value.device_mesh, [Replicate()]).to_local()
    return value


def _gather_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(map(_whole, args)), {key: _whole(value) for key, value in kwargs.items()}


def _shard_output(mesh: DeviceMesh, module: nn.Module, args: tuple, output):
    def shards(tensor: torch.Tensor) -> DTensor:
        whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
        return whole.redistribute(mesh, [Shard(1)])

    return (shards(output[0]), *output[1:]) if isinstance(output, tuple) else shards(output)


HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


# The width of all heads together, which some attention code reshapes its output to (XGLM's).
HEADS_WIDTH = ("embed_dim",)


class _LocalHeads(ParallelStyle):
    """An attention module that reshapes by its own head counts (``self.num_heads``, not ``-1``)
    or the width of all its heads (``self.embed_dim``) over colwise q/k/v: each becomes this rank's
    share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in (*HEAD_COUNTS, *HEADS_WIDTH):
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, name, value // device_mesh.size())
        return module


# Hugging Face style names that are one of ours under another name.
_ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}


class _MlaKvAProj(ParallelStyle):
    """HF's ``mla_kv_a_proj``: MLA's replicated ``kv_a_proj_with_mqa``, whose output ends in the
    rotary key part that goes to the attention of this rank's heads without passing a colwise
    projection (the rest does, through ``kv_b_proj``, which sums its input's gradient). That
    part's gradient is partial on each rank: summed over the TP ranks in the backward."""

    def __init__(self, rope_dim: int):
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, output):
            passed, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], -1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([passed, rope.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(hook)
        return module


class _Owned(ParallelStyle):
    """A style whose module's plain-tensor output is a tensor of its own, not the view of a
    DTensor's storage that ``to_local`` returns: code that adds to it in place (Llama 4's MoE
    block adds its routed experts to the shared expert's output with ``add_``) is then allowed."""

    def __init__(self, style: ParallelStyle):
        self.style = style
        self.output_layouts = style.output_layouts  # read by LoRA's parallelize_tp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(_own_output)
        return module


def _own_output(module: nn.Module, args: tuple, output):
    made_by_to_local = "ToTorchTensor" in type(getattr(output, "grad_fn", None)).__name__
    return output.clone() if made_by_to_local else output


class _LocalParams(ParallelStyle):
    """HF's ``local_params``: the module's forward sees its sharded parameters as this rank's
    slices (attention sinks of this rank's heads, beside local q/k/v), their gradients those
    slices' (no reduction). Every direct parameter of such a module is sharded (``_resolve``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_localize)
        module.register_forward_hook(_restore)
        return module


def _localize(module: nn.Module, args: tuple) -> None:
    shards = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._tp_shards = shards
    module._parameters.update({name: shard.to_local() for name, shard in shards.items()})


def _restore(module: nn.Module, args: tuple, output):
    module._parameters.update(module.__dict__.pop("_tp_shards", {}))
    return output


class _LocalParamsAllReduce(_LocalParams):
    """HF's ``all_reduce`` on a module whose own parameters the plan shards (Inkling's shared
    experts: 3-D gate/up split on their rows, down on its columns): the forward runs on this
    rank's slices (``local_params``) and sums the partial outputs over the TP ranks; each tensor
    input's gradient, partial on each rank (its slices' share), is summed in the backward."""

    def __init__(self, sequence_parallel: bool):
        self.tokens = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(partial(_summed_backward, device_mesh), with_kwargs=True)
        module.register_forward_hook(partial(_summed_output, device_mesh, self.tokens))
        return module


def _summed_backward(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict):
    def summed(value):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return value.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    return tuple(map(summed, args)), {key: summed(value) for key, value in kwargs.items()}


def _summed_output(mesh: DeviceMesh, tokens, module: nn.Module, args: tuple, output):
    whole = DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(
        mesh, [tokens]
    )
    return whole.to_local() if isinstance(tokens, Replicate) else whole


class _ReplicatedParameters(ParallelStyle):
    """Ours: a module whose own parameters meet sequence shards (Doge's residual scales on the
    decoder block) under sequence parallelism: they become Replicate DTensors, whose gradients,
    partial over the shards, are summed when they are finalised. Its children are untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute_parameter(module, name, device_mesh, Replicate())
        return module


def _distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    """Make the module's own parameter ``name`` a DTensor of ``placement`` on ``mesh`` (each rank
    keeps its part of its own data: nothing is sent)."""
    full = module._parameters[name]
    local = distribute_tensor(full.data, mesh, [placement], src_data_rank=None)
    module._parameters[name] = nn.Parameter(local, requires_grad=full.requires_grad)


class _ShardParameter(ParallelStyle):
    """A plan entry naming a parameter: that parameter of the module becomes a DTensor sharded on
    ``dim`` (each rank reads only its slice when it loads)."""

    def __init__(self, parameter: str, dim: int):
        self.parameter, self.dim = parameter, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameter(module, self.parameter, device_mesh, Shard(self.dim))
        return module


# HF's styles on a parameter, as the dimension they shard (of an ``ndim``-D parameter).
_PARAMETER_STYLES = {
    "colwise": lambda ndim: max(ndim - 2, 0),
    "rowwise": lambda ndim: ndim - 1,
}
# HF's styles for experts (tensor parallelism inside every expert): the experts are split by
# expert parallelism instead, so a plan's entries for them are left out (``models.families``).
EXPERT_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert")


# Styles that do not depend on sequence parallelism or the config.
_PLAIN_STYLES = {
    "sequence_parallel": SequenceParallel,
    "gather_sequence": _GatherSequence,
    "local_heads": _LocalHeads,
    "local_params": _LocalParams,
    "sequence_parallel_parameters": _ReplicatedParameters,
    # ours: outputs per head from all heads (Doge's dt_proj), each rank keeps its heads'
    "rowwise_local_heads": lambda: RowwiseParallel(output_layouts=Shard(-1)),
}


def _style(name: str, sequence_parallel: bool, config=None) -> ParallelStyle | None:
    """The torch style for a style name; None for styles that only mark a replicated module.

    Under sequence parallelism activations between blocks are DTensors sharded on the sequence
    (``use_local_output=False``): HF code that reads ``hidden_states.shape`` (positions, the causal
    mask, the attention reshape) sees the global length, with any attention implementation."""
    tokens = Shard(1) if sequence_parallel else Replicate()
    local_output = not sequence_parallel  # under SP the outputs stay DTensors (see above)
    styles = {
        # Under SP the input arrives as a DTensor (gathered by the block's *_input style, or sharded
        # by a norm), redistributed to Replicate whatever ``input_layouts`` says.
        "colwise": lambda: ColwiseParallel(),
        # One gather (SP) or one backward all-reduce (plain) per block instead of one per
        # projection: the block's input becomes a Replicate DTensor that q/k/v (or gate/up) share.
        "attention_input": lambda: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": tokens},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        "mlp_input": lambda: PrepareModuleInput(
            input_layouts=(tokens,), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "rowwise": lambda: _Owned(
            RowwiseParallel(output_layouts=tokens, use_local_output=local_output)
        ),
        "embedding_rowwise": lambda: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
        ),
        "vocab_parallel": lambda: ColwiseParallel(
            input_layouts=tokens, output_layouts=Shard(-1), use_local_output=False
        ),
        "colwise_gather_output": lambda: ColwiseParallel(
            input_layouts=tokens, output_layouts=Replicate()
        ),
        # HF's: a Linear whose input is whole on every rank (after a colwise_gather_output, where
        # the model slices or normalises the whole projection): each rank multiplies its slice of
        # the input by its rows, the partial outputs are summed. The backward all-gathers the
        # input's gradient slices, so what comes before sees the whole gradient, as at tp=1.
        "rowwise_split_input": lambda: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
        ),
        # HF's: a module whose output is partial over the TP ranks (a shared expert's sum of
        # rowwise outputs computed locally), summed in the forward; its gradient is replicated.
        "all_reduce": lambda: PrepareModuleOutput(
            output_layouts=(Partial(),),
            desired_output_layouts=(tokens,),
            use_local_output=local_output,
        ),
        # HF's: an embedding sharded over the hidden dimension, the vectors gathered
        "embedding_colwise": lambda: ColwiseParallel(
            input_layouts=Replicate(), output_layouts=tokens, use_local_output=local_output
        ),
        "mla_kv_a_proj": lambda: _MlaKvAProj(getattr(config, "qk_rope_head_dim", 0)),
        "local_params_all_reduce": lambda: _LocalParamsAllReduce(sequence_parallel),
        **dict.fromkeys(("replicated_with_grad_allreduce", "replicate"), lambda: None),
        **_PLAIN_STYLES,
    }
    name = _ALIASES.get(name, name)
    _refuse_expert_style(name)
    if name not in styles:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {sorted(styles)}")
    return styles[name]()


def _refuse_expert_style(name: str) -> None:
    if name in EXPERT_STYLES:
        raise ValueError(
            f"{name!r} is Hugging Face's tensor parallelism inside MoE experts, for experts only: "
            "experts are split by expert parallelism here (their plan entries are left out)"
        )


@dataclass(kw_only=True)
class PlanReport:
    """Which parameters the plan sharded, and which stay replicated with which gradient
    reduction."""

    sharded: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A short summary: replicated parameters grouped by pattern (layer indices as ``*``)."""
        lines = [
            f"tensor-parallel plan: {len(self.sharded)} parameters sharded, "
            f"{len(self.replicated)} replicated"
        ]
        groups: dict[tuple[str, str], int] = {}
        for name, reduction in self.replicated.items():
            key = (re.sub(r"\.\d+\.", ".*.", name), reduction)
            groups[key] = groups.get(key, 0) + 1
        lines += [
            f"  replicated ({reduction}): {name} ×{count}"
            for (name, reduction), count in sorted(groups.items())
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _resolve(
    model: nn.Module, plan: dict[str, str], config=None
) -> tuple[dict[str, str], list[str], list[str]]:
    """Expand patterns to module names: (resolved, errors, notes).

    A pattern matching nothing is an error, unless it is one of the model's own
    ``base_model_tp_plan`` (transformers writes one plan for every layer kind of an architecture,
    dense and MoE layers, and a given configuration may have only some): then it is a note, as
    long as some pattern of that plan matches. A pattern may name parameters (a style of
    :data:`_PARAMETER_STYLES`); their modules then run on local tensors (``local_params``).
    """
    names = [name for name, _ in model.named_modules() if name]
    parameters = [name for name, _ in model.named_parameters()]
    own = {f"model.{p}" for p in (getattr(config, "base_model_tp_plan", None) or {})}
    resolved: dict[str, str] = {}
    unmatched = []
    for pattern, style in plan.items():
        matches = fnmatch.filter(names, pattern) or fnmatch.filter(parameters, pattern)
        if not matches:
            unmatched.append((pattern, style))
        for name in matches:
            resolved[name] = style
    own_matched = any(fnmatch.filter(names, pattern) for pattern in own)
    model_name = type(model).__name__
    errors, notes = _parameter_problems(resolved, set(parameters), model_name)
    for pattern, style in unmatched:
        if pattern in own and own_matched:
            notes.append(
                f"plan pattern {pattern!r} ({style}) ignored: {model_name} has no such layers"
            )
        else:
            errors.append(f"plan pattern {pattern!r} ({style}) matches no module of {model_name}")
    return _summed_already(resolved, notes), errors, notes


def _parameter_problems(
    resolved: dict[str, str], parameters: set[str], model_name: str
) -> tuple[list[str], list[str]]:
    """(errors, notes) of the entries naming parameters: a style that cannot shard one is an error;
    the owner of a sharded one gets ``local_params`` where the plan has none (a note). A
    ``local_params`` module's parameter the plan does not shard is an error: on local tensors its
    gradient may be partial over TP (this rank's heads) or whole, which the plan does not say."""
    errors, notes = [], []
    for name, style in sorted(resolved.items()):
        if name not in parameters:
            continue
        owner = name.rpartition(".")[0]
        if style not in _PARAMETER_STYLES:
            errors.append(
                f"plan shards the parameter {name} of {model_name} with {style!r}: a parameter "
                f"takes only {sorted(_PARAMETER_STYLES)}"
            )
        elif resolved.get(owner) == "all_reduce":  # its sharded parameters' partial sums
            resolved[owner] = "local_params_all_reduce"
        elif resolved.get(owner, "local_params") not in _LOCAL:
            errors.append(
                f"plan shards the parameter {name} and gives its module {owner} "
                f"{resolved[owner]!r}: its module needs 'local_params'"
            )
        elif owner not in resolved:
            resolved[owner] = "local_params"
            notes.append(f"{owner}: local_params added, its parameter {name} is sharded")
    for name in sorted(n for n, style in resolved.items() if style in _LOCAL):
        unsharded = [p for p in sorted(parameters) if p.rpartition(".")[0] == name]
        unsharded = [p for p in unsharded if p not in resolved]
        if unsharded:
            errors.append(
                f"{name} (local_params): the plan does not shard its parameter {unsharded[0]}, "
                "whose gradient on local tensors it leaves undefined (partial or whole over TP)"
            )
    return errors, notes


_LOCAL = ("local_params", "local_params_all_reduce")
_ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")


def _summed_already(resolved: dict[str, str], notes: list[str]) -> dict[str, str]:
    """``all_reduce`` sums a module's partial output; where a rowwise module inside it already
    sums it (a shared expert's ``down_proj``), a second sum would multiply it by tp: the module
    stays as is, noted."""
    for name, style in resolved.items():
        inner = [n for n, s in resolved.items() if n.startswith(f"{name}.") and s in _ROWWISE]
        if style == "all_reduce" and inner:
            resolved[name] = "replicate"
            notes.append(f"{name}: all_reduce left out, its rowwise {inner[0]} sums the output")
    return resolved


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def tp_size_errors(config, tp: int) -> list[str]:
    """The model's sizes that ``tp`` must divide and does not (heads, KV heads, intermediate)."""
    errors = []
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key, None)
        sizes = value if isinstance(value, list | tuple) else [value]  # Gemma 3n's: per layer
        if any(size is not None and size % tp for size in sizes):
            errors.append(f"tp ({tp}) must divide {key} ({value})")
    return errors


def check_plan(
    model: nn.Module,
    config,
    plan: dict[str, str],
    tp: int,
    moe_modules: tuple[str, ...] = (),
    *,
    sizes: bool = True,
) -> tuple[dict[str, str], list[str]]:
    """Resolve the plan and list every reason it cannot run at this ``tp`` (empty when it can);
    ``sizes=False`` leaves out :func:`tp_size_errors` (for a caller that reports them itself).

    ``moe_modules`` are patterns of expert and router modules: a dense style on them (or inside
    them) is refused, because experts are split by expert parallelism and routers must see whole
    tokens. Vocabulary not divisible by tp is not an error: the embedding and ``lm_head`` then stay
    replicated (a documented fallback, noted in the report) because uneven vocab shards would break
    the loss.
    """
    resolved, errors, _ = _checked(model, config, plan, tp, moe_modules, sizes)
    return resolved, errors


def _checked(
    model: nn.Module, config, plan: dict[str, str], tp: int, moe_modules: tuple, sizes: bool
) -> tuple[dict[str, str], list[str], list[str]]:
    """:func:`check_plan`, with the resolution's notes: (resolved, errors, notes)."""
    resolved, errors, notes = _resolve(model, plan, config)
    for name, style in resolved.items():
        owner = next(
            (p for p in moe_modules if any(fnmatch.fnmatch(a, p) for a in _ancestors(name))), None
        )
        if owner is not None:
            errors.append(
                f"plan shards {name} with {style!r}, but it is an MoE expert or router ({owner}); "
                "remove it"
            )
    parameters = {name for name, _ in model.named_parameters()}
    for name, style in resolved.items():
        if name in parameters:  # checked by _resolve
            continue
        try:
            _style(style, False)
        except ValueError as error:
            errors.append(f"{name}: {error}")
        if style == "mla_kv_a_proj" and not getattr(config, "qk_rope_head_dim", None):
            errors.append(f"{name}: mla_kv_a_proj needs the config's qk_rope_head_dim")
        supported = getattr(model.get_submodule(name), "tp_styles", None)  # LoRA's
        if supported is not None and style not in supported:
            kind = type(model.get_submodule(name)).__name__
            errors.append(f"{name} ({kind}) can be split only as {supported}, not {style!r}")
    if sizes:
        errors += tp_size_errors(config, tp)
    if "sequence_parallel" in resolved.values():
        errors += _sequence_parallel_errors(model, config, resolved, tp)
    return resolved, errors, notes


def _sequence_parallel_errors(model: nn.Module, config, resolved: dict[str, str], tp: int):
    """What a sequence-parallel plan cannot run: a replicated vocabulary or embedding (its whole
    output would reach the norms as if it were this rank's sequence shard), MLA attention (its
    low-rank projections are plain linears that cannot take sequence shards)."""
    errors = []
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab % tp:
        errors.append(
            f"sequence parallelism needs tp ({tp}) to divide vocab_size ({vocab}); use sp=false"
        )
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    replicated = [n for n, s in resolved.items() if s == "replicate"]
    whole = [name for name in replicated if model.get_submodule(name) is embedding]
    if whole:
        errors.append(
            f"sequence parallelism with a replicated embedding ({whole[0]}, not split: it holds "
            "modules of its own, such as a norm after the lookup) is not supported; use sp=false"
        )
    if "mla_kv_a_proj" in resolved.values():
        errors.append(
            "sequence parallelism with MLA attention (mla_kv_a_proj) is not supported; use sp=false"
        )
    return errors


def _vocabulary_modules(model: nn.Module) -> set[str]:
    """The names of the embedding and the head (a module with neither: every module, so a vocab
    style anywhere counts as theirs)."""
    ends = [
        getattr(model, f"get_{kind}_embeddings", lambda: None)() for kind in ("input", "output")
    ]
    if all(end is None for end in ends):
        return {name for name, _ in model.named_modules()}
    return {name for name, module in model.named_modules() if any(module is e for e in ends)}


def apply_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, str],
    config,
    sequence_parallel: bool = False,
    moe_modules: tuple[str, ...] = (),
) -> PlanReport:
    """Check the plan against the model and ``tp``, then shard the model in place; return the
    coverage.

    Raises:
        ValueError: listing every problem (``"tp (4) must divide num_key_value_heads (2)"``,
            patterns that match nothing, unknown styles) before any parameter is touched.
    """
    tp = tp_mesh.size()
    resolved, errors, notes = _checked(model, config, plan, tp, moe_modules, sizes=True)
    if errors:
        raise ValueError("; ".join(errors))
    report = PlanReport(notes=notes)
    vocab = config.vocab_size
    tied = getattr(config, "tie_word_embeddings", False)
    if vocab % tp:
        report.notes.append(
            f"vocab_size ({vocab}) is not divisible by tp ({tp}): embedding and lm_head replicated"
        )
        vocabulary = _vocabulary_modules(model)
        resolved = {
            name: "replicate" if style in _VOCAB_STYLES and name in vocabulary else style
            for name, style in resolved.items()
        }

    gathered = [name for name, style in resolved.items() if style == "gather_sequence"]
    parameters = {name for name, _ in model.named_parameters()}
    for name, style in sorted(resolved.items()):
        if name in parameters:
            owner, _, attribute = name.rpartition(".")
            dim = _PARAMETER_STYLES[style](model.get_parameter(name).dim())
            parallelize_module(model.get_submodule(owner), tp_mesh, _ShardParameter(attribute, dim))
            continue
        module = model.get_submodule(name)
        if style == "replicated_with_grad_allreduce":
            mark_tp_replica_gradient_reduction(module, "sum")
        inside = any(name.startswith(f"{outer}.") for outer in gathered)  # on whole tokens
        torch_style = _style(style, sequence_parallel and not inside, config)
        spread = sequence_parallel and not inside
        torch_style = float8_style(style, module, spread, tp_mesh) or torch_style
        # torch's SequenceParallel makes new parameters that require grad: a frozen one stays so
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        if hasattr(module, "parallelize_tp") and torch_style is not None:  # LoRA's adapters
            module.parallelize_tp(tp_mesh, style, torch_style)
        elif torch_style is not None:
            parallelize_module(module, tp_mesh, torch_style)
        for parameter_name, parameter in module.named_parameters():
            parameter.requires_grad_(parameter_name not in frozen and parameter.requires_grad)
    embedding, head = model.get_input_embeddings(), getattr(model, "lm_head", None)
    if tied and embedding is not None and hasattr(head, "weight"):  # both held: not a pp stage
        head.weight = embedding.weight

    for name, parameter in model.named_parameters():
        if isinstance(parameter, DTensor) and any(
            isinstance(p, Shard) for p in parameter.placements
        ):
            report.sharded[name] = str(parameter.placements)
        else:
            module = model.get_submodule(name.rpartition(".")[0])
            report.replicated[name] = tp_replica_reduction(module)
    return report


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False
) -> torch.Tensor:
    """Sum of next-token cross entropy over positions with a label (``-100`` is ignored).

    ``logits`` [batch, seq, vocab] may be a DTensor sharded over the vocabulary
    (``vocab_parallel``): then call this *and the backward* inside
    ``torch.distributed.tensor.parallel.loss_parallel()``, which computes the softmax across vocab
    shards; the result is then a Replicate DTensor scalar. ``labels`` [batch, seq] are aligned with
    the inputs and shifted here, or with ``shifted`` already the targets of each position (a context
    parallel shard's). The *sum* lets the caller divide by the token count of the whole global
    batch, so gradient accumulation and dp splits change nothing.
    """
    if not shifted:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
    flat_logits = logits.flatten(0, 1).float()
    return F.cross_entropy(flat_logits, labels.flatten(), ignore_index=-100, reduction="sum")
