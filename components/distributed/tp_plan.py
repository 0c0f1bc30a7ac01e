"""The one function that checks and applies any tensor-parallel plan. Plans are data
(``components.models.families.plan_for``): ``fnmatch`` patterns (``*`` for a layer index) of
module (or parameter) names mapped to style names of HF's ``base_model_tp_plan``, the styles
``components/distributed/tp_styles.py`` makes:

- ``colwise`` / ``rowwise`` (on a parameter: its first / last dimension; fp8: ``float8_tp``),
  ``embedding_rowwise``, ``vocab_parallel`` (ours) / ``colwise_gather_output``: Megatron-style
  pairs and the vocabulary.
- ``sequence_parallel``; ``local_heads`` (ours: head counts made this rank's); ``local_params``
  (sharded parameters seen as this rank's slices; ``all_reduce`` over them: summed outputs).
- ``replicated_with_grad_allreduce`` (gradient ``sum``) / ``replicate`` (``mean``): not sharded.
- HF's ``rowwise_split_input``, ``all_reduce``, ``embedding_colwise``, ``mla_kv_a_proj`` (aliases
  ``colwise_rep``, ``rowwise_rep``); HF's expert styles (``moe_tp_experts``, ``packed_*``,
  ``moe_identity_expert``) are replaced by expert parallelism (``components.moe``).
All checked before any parameter is sharded, all problems together (docs/design-notes.md).
"""

import fnmatch
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    parallelize_module,
)

from components.distributed.float8_tp import float8_style
from components.distributed.layout import tp_size_errors, tp_sizes
from components.distributed.tp_replicas import (
    mark_tp_replica_gradient_reduction,
    tp_replica_reduction,
)
from components.distributed.tp_styles import (
    PARAMETER_STYLES,
    VOCAB_STYLES,
    ShardParameter,
    torch_style_of,
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
    :data:`PARAMETER_STYLES`); their modules then run on local tensors (``local_params``).
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
        if style not in PARAMETER_STYLES:
            errors.append(
                f"plan shards the parameter {name} of {model_name} with {style!r}: a parameter "
                f"takes only {sorted(PARAMETER_STYLES)}"
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
            torch_style_of(style, False)
        except ValueError as error:
            errors.append(f"{name}: {error}")
        if style == "mla_kv_a_proj" and not getattr(config, "qk_rope_head_dim", None):
            errors.append(f"{name}: mla_kv_a_proj needs the config's qk_rope_head_dim")
        supported = getattr(model.get_submodule(name), "tp_styles", None)  # LoRA's
        if supported is not None and style not in supported:
            kind = type(model.get_submodule(name)).__name__
            errors.append(f"{name} ({kind}) can be split only as {supported}, not {style!r}")
    if sizes:
        errors += tp_size_errors(tp_sizes(config), tp)
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
            name: "replicate" if style in VOCAB_STYLES and name in vocabulary else style
            for name, style in resolved.items()
        }

    gathered = [name for name, style in resolved.items() if style == "gather_sequence"]
    parameters = {name for name, _ in model.named_parameters()}
    for name, style in sorted(resolved.items()):
        if name in parameters:
            owner, _, attribute = name.rpartition(".")
            dim = PARAMETER_STYLES[style](model.get_parameter(name).dim())
            parallelize_module(model.get_submodule(owner), tp_mesh, ShardParameter(attribute, dim))
            continue
        module = model.get_submodule(name)
        if style == "replicated_with_grad_allreduce":
            mark_tp_replica_gradient_reduction(module, "sum")
        inside = any(name.startswith(f"{outer}.") for outer in gathered)  # on whole tokens
        torch_style = torch_style_of(style, sequence_parallel and not inside, config)
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
