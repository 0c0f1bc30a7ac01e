"""Expert parallelism for Hugging Face MoE blocks (transformers 5 fused experts), over any ranks of
the world.

Each rank of an ``ep`` group (``ep`` adjacent ranks of the MoE mesh ``("ep_shard", "ep")``) keeps
E/ep whole experts of the fused ``experts.gate_up_proj`` and ``experts.down_proj``: DTensors
``Shard(0)`` on ``ep`` and ``Replicate`` on ``ep_shard`` (``Shard(1)`` with ``shard_experts=True``).

Tokens reach the experts one of two ways, chosen by :func:`dispatch_mode`: ``folded`` (``ep == tp``:
one all-reduce over the ep group sums the outputs) or ``all_to_all`` (each (token, choice) row goes
to the rank holding its expert and back). A rank runs its experts as ``expert_compute.py`` does:
two ``torch._grouped_mm`` calls, or a per-expert loop where grouped GEMM cannot run.

Design notes: docs/design-notes.md
"""

import dataclasses
import fnmatch
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard, distribute_tensor

from components.distributed.tp_replicas import exclude_from_tp_replica_sync
from components.moe.collectives import (
    all_to_all_rows,
    block,
    enter_group,
    exchange,
    gather_rows,
    scale_gradient,
    scatter_rows,
    sum_over_group,
)
from components.moe.expert_compute import run_experts
from components.moe.expert_lora import (
    ADAPTED_WEIGHTS,
    ADAPTERS,
    expert_low_rank,
    has_expert_adapters,
)
from components.moe.structure import takes_routing

EXPERT_PARAMETERS = ADAPTED_WEIGHTS  # the experts' weights, in registration order
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")  # GPT-OSS's (``has_bias``)
DISPATCH_MODES = ("folded", "all_to_all")
# transformers' experts flags (``use_experts_implementation``) whose other value this module's
# forward does not compute: (attribute, the value it computes, what the other value means).
# Transposed weights, biases and interleaved gate/up rows (GPT-OSS, its gate the module's own
# ``_apply_gate``: a clamped SwiGLU) are computed.
_OTHER_FORMS = (
    ("has_gate", True, "no gate"),
    ("has_post_expert_norm", False, "a norm after each expert"),
)
_ADAPTER_FORMS = (  # what the experts' forward computes, but not yet with per-expert adapters
    ("is_transposed", False, "transposed weights"),
    ("has_bias", False, "biases"),
    ("is_concatenated", True, "interleaved gate and up rows"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """Where one experts module's experts live and how its tokens reach them."""

    mode: str  # folded | all_to_all
    group: dist.ProcessGroup  # the ep group
    size: int  # ep
    first_expert: int  # this rank's first expert
    experts_per_rank: int
    tp_group: (
        dist.ProcessGroup | None
    )  # all_to_all: the TP group whose replicated tokens are split first
    tp_rank: int
    tp_size: int
    gradient_placements: tuple[
        Placement, ...
    ]  # of the local weights' gradients on ("ep_shard", "ep")
    gradient_scale: float
    sharded: bool = False  # weights Shard(1) over ep_shard (FSDP-style), gathered for each forward


def dispatch_mode(tp: int, ep: int) -> str:
    """``folded`` when the ep group is the TP group (``ep == tp``), else ``all_to_all`` (measured
    faster at ``ep < tp`` too, see the module docstring)."""
    return "folded" if tp == ep else "all_to_all"


def expert_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """Names of the modules ``patterns`` match, sorted."""
    names = [name for name, _ in model.named_modules() if name]
    return sorted({name for pattern in patterns for name in fnmatch.filter(names, pattern)})


def _local_weights(experts: nn.Module, dtype: torch.dtype) -> tuple:
    """This rank's ``gate_up_proj`` and ``down_proj`` in ``dtype`` (FSDP leaves experts in their
    own dtype; they compute in the activations'), their biases (GPT-OSS; else an empty tuple) and
    their adapters (:mod:`expert_lora`, or None), each with the layout's gradient placements and
    scale. Adapters are never sharded over ``ep_shard``: only the weights are gathered."""
    layout: ExpertLayout = experts.layout

    def local(weight: torch.Tensor, gather: bool = False) -> torch.Tensor:
        if gather:  # all-gather over ep_shard; its backward reduce-scatters the gradient
            weight = weight.redistribute(weight.device_mesh, (Replicate(), Shard(0)))
        local = weight.to_local(grad_placements=layout.gradient_placements)
        if layout.gradient_scale != 1.0:
            local = scale_gradient(local, layout.gradient_scale)
        return local.to(dtype)

    gate_up, down, *biases = (local(getattr(experts, n), layout.sharded) for n in _names(experts))
    return gate_up, down, tuple(biases), expert_low_rank(experts, local)


def _names(experts: nn.Module) -> tuple[str, ...]:
    return EXPERT_PARAMETERS + (EXPERT_BIASES if getattr(experts, "has_bias", False) else ())


def _folded_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
):
    """This rank's experts on the (replicated) tokens routed to them, then the sum over the ep
    group."""
    layout: ExpertLayout = self.layout
    gate_up, down, biases, low_rank = _local_weights(self, hidden_states.dtype)
    hidden_states, top_k_weights = enter_group(hidden_states, top_k_weights, layout.group)
    experts = (layout.first_expert, gate_up, down, low_rank, biases)
    output = _routed_to(self, hidden_states, top_k_index, top_k_weights, *experts)
    return sum_over_group(output, layout.group)


def _routed_to(
    self, hidden_states, top_k_index, top_k_weights, first, gate_up, down, low_rank, biases=()
):
    """The sum over each token's choices of the local experts (numbered from ``first``) it chose,
    weighted; zeros for a token that chose none of them."""
    local = top_k_index - first
    token, slot = torch.where((local >= 0) & (local < len(gate_up)))
    rows, weights = hidden_states[token], top_k_weights[token, slot]
    output = run_experts(self, rows, local[token, slot], gate_up, down, weights, low_rank, biases)
    return torch.zeros_like(hidden_states).index_add(0, token, output)


def run_whole_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The forward of an unsplit experts module (every expert here, ep=1) with per-expert
    adapters (:mod:`expert_lora`): the same computation as a rank's share of the split one."""
    dtype = hidden_states.dtype
    gate_up, down = (getattr(experts, name).to(dtype) for name in EXPERT_PARAMETERS)
    low_rank = expert_low_rank(experts, lambda tensor: tensor.to(dtype))
    return _routed_to(
        experts, hidden_states, top_k_index, top_k_weights, 0, gate_up, down, low_rank
    )


def _own_block(layout: ExpertLayout, hidden_states, top_k_index, top_k_weights):
    """This TP rank's block of the replicated tokens, padded so every rank's block has the same
    size."""
    if layout.tp_size == 1:
        return hidden_states, top_k_index, top_k_weights
    pad = -hidden_states.shape[0] % layout.tp_size
    if pad:
        hidden_states = torch.cat(
            [hidden_states, hidden_states.new_zeros(pad, hidden_states.shape[1])]
        )
        top_k_weights = torch.cat(
            [top_k_weights, top_k_weights.new_zeros(pad, top_k_weights.shape[1])]
        )
        top_k_index = torch.cat(
            [top_k_index, top_k_index.new_full((pad, top_k_index.shape[1]), -1)]
        )
    where = (layout.tp_group, layout.tp_rank, layout.tp_size)
    index = block(top_k_index, layout.tp_rank, layout.tp_size)  # integers: no gradient to gather
    return scatter_rows(hidden_states, *where), index, scatter_rows(top_k_weights, *where)


def _dispatched_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
):
    """Send each (token, choice) to its expert's rank, compute there, bring the result back, weight
    and sum."""
    layout: ExpertLayout = self.layout
    gate_up, down, biases, low_rank = _local_weights(self, hidden_states.dtype)
    hidden, index, weights = _own_block(layout, hidden_states, top_k_index, top_k_weights)
    choices = index.reshape(-1)
    order = torch.argsort(choices, stable=True)
    order = order[choices[order] >= 0]  # padding rows choose no expert
    token, slot, expert = order // index.shape[1], order % index.shape[1], choices[order]
    destination = expert // layout.experts_per_rank
    send = torch.bincount(destination, minlength=layout.size)
    receive = exchange(send, [1] * layout.size, [1] * layout.size, layout.group).tolist()
    send = send.tolist()
    received = all_to_all_rows(hidden[token], send, receive, layout.group)
    expert_of_row = exchange(
        expert - destination * layout.experts_per_rank, send, receive, layout.group
    )
    computed = run_experts(self, received, expert_of_row, gate_up, down, None, low_rank, biases)
    results = all_to_all_rows(computed, receive, send, layout.group)
    output = torch.zeros_like(hidden).index_add(
        0, token, results * weights[token, slot, None].to(results.dtype)
    )
    if layout.tp_size == 1:
        return output
    return gather_rows(output, layout.tp_group, layout.tp_rank, layout.tp_size)[
        : hidden_states.shape[0]
    ]


def _routed_compute(self, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
    """Llama 4's experts on rows already routed (every token once per local expert, scaled by its
    score, grouped by expert): its own two ``bmm`` of transposed weights, gate and up halves."""
    hidden = rows.view(gate_up.shape[0], -1, rows.shape[-1])
    gate, up = torch.bmm(hidden, gate_up).chunk(2, dim=-1)
    return torch.bmm(up * self.act_fn(gate), down).view(-1, down.shape[-1])


def _routed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Experts handed every token once per expert (Llama 4: rows grouped by expert): this rank's
    experts' rows computed here. Folded: every rank of the ep group holds the same rows; its block
    is taken and the blocks gathered back. All-to-all (tp = 1): each rank's rows of each expert
    go to the expert's rank and come back."""
    layout: ExpertLayout = self.layout
    gate_up, down, _, _ = _local_weights(self, hidden_states.dtype)  # no biases, no adapters
    rank = layout.first_expert // layout.experts_per_rank
    where = (layout.group, rank, layout.size)
    if layout.mode == "folded":
        own = _routed_compute(self, scatter_rows(hidden_states, *where), gate_up, down)
        return gather_rows(own, *where)
    rows_per_rank = hidden_states.shape[0] // layout.size  # this rank's tokens x local experts
    counts = torch.tensor([rows_per_rank] * layout.size, device=hidden_states.device)
    receive = exchange(counts, [1] * layout.size, [1] * layout.size, layout.group).tolist()
    send = [rows_per_rank] * layout.size
    received = all_to_all_rows(hidden_states, send, receive, layout.group)
    computed = [_routed_compute(self, c, gate_up, down) for c in received.split(receive)]
    return all_to_all_rows(torch.cat(computed), receive, send, layout.group)


def experts_problem(module: nn.Module, unsupported: str, adapters: bool = False) -> str | None:
    """Why this experts module's forward is not the one :class:`ExpertParallelExperts` computes
    (a phrase to follow its name, ending in ``unsupported``), or None. With ``adapters``: what
    per-expert adapters need too (tokens routed to the module, plain weights and rows)."""
    missing = [p for p in EXPERT_PARAMETERS if not hasattr(module, p)]
    other = _OTHER_FORMS + (_ADAPTER_FORMS if adapters else ())
    forms = [what for flag, plain, what in other if getattr(module, flag, plain) != plain]
    if missing:
        return f"has no fused expert parameters {missing}: not a transformers 5 experts module"
    if not takes_routing(module) and (adapters or getattr(module, "has_bias", False)):
        what = "takes its tokens already routed" + ("" if adapters else ", has biases")
        return f"({type(module).__name__}) {what}: {unsupported}"
    if forms:
        return f"({type(module).__name__}) has {', '.join(forms)}: {unsupported}"
    routed, rows = module.down_proj.shape[0], module.gate_up_proj.shape[0]
    if rows != routed:  # LongCat's zero experts (HF's moe_identity_expert) beside the routed ones
        return (
            f"({type(module).__name__}) has {rows - routed} identity experts beside its {routed} "
            f"routed ones: {unsupported}"
        )
    return None


def check_expert_parallel(
    model: nn.Module, patterns: list[str], num_experts: int, ep: int
) -> list[str]:
    """Every reason expert parallelism cannot run at ``ep`` whatever the tp (empty when it can);
    ``ep`` dividing the world, and dividing tp where experts take tokens already routed
    (:func:`routed_experts`), are the layout's rules (``components/distributed/layout.py``)."""
    errors = []
    if ep > 1 and not patterns:
        errors.append(f"ep={ep} needs an MoE model: model.experts names no expert modules")
        return errors
    modules = expert_modules(model, patterns)
    for pattern in patterns:
        if not fnmatch.filter(modules, pattern):
            errors.append(
                f"model.experts pattern {pattern!r} matches no module of {type(model).__name__}"
            )
    unsupported = "expert parallelism of such experts is not supported yet; use ep=1"
    found = _named_problems(model, modules, lambda module: experts_problem(module, unsupported))
    errors += [f"{names} {problem}" for problem, names in found.items()]
    if num_experts % ep:
        errors.append(f"ep ({ep}) must divide the number of experts ({num_experts})")
    return errors


def routed_experts(model: nn.Module, patterns: list[str]) -> str | None:
    """The expert modules ``patterns`` names that are called with tokens already routed (Llama
    4's) and otherwise split, named as a problem names them (the first, how many more, the
    class); None when there are none."""
    found = _named_problems(model, expert_modules(model, patterns), _routed_kind)
    return next((f"{names} {kind}" for kind, names in found.items()), None)


def _routed_kind(module: nn.Module) -> str | None:
    """``(ClassName)`` of an experts module expert parallelism splits that is called with tokens
    already routed; None for any other."""
    plain = experts_problem(module, "") is None and not takes_routing(module)
    return f"({type(module).__name__})" if plain else None


def _named_problems(model: nn.Module, modules: list[str], problem_of) -> dict[str, str]:
    """Each problem ``problem_of`` finds among ``modules`` once, with the modules that have it
    named: the first, and how many more."""
    found: dict[str, list[str]] = {}
    for name in modules:
        if (problem := problem_of(model.get_submodule(name))) is not None:
            found.setdefault(problem, []).append(name)
    named = {}
    for problem, names in found.items():
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        named[problem] = f"{names[0]}{more}"
    return named


def expert_layout(
    moe_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    experts_per_rank: int,
    mode: str,
    sharded: bool = False,
) -> ExpertLayout:
    """Where this rank's experts live and how tokens reach them in ``mode`` (``folded`` needs ep to
    divide tp); :func:`apply_expert_parallel` uses :func:`dispatch_mode`'s."""
    folded_fits = tp_mesh is not None and tp_mesh.size() % moe_mesh["ep"].size() == 0
    if mode not in DISPATCH_MODES or (mode == "folded" and not folded_fits):
        raise ValueError(
            f"expert dispatch {mode!r} does not fit ep={moe_mesh['ep'].size()} "
            "(folded needs ep to divide tp)"
        )
    ep_mesh, ep_shard = moe_mesh["ep"], moe_mesh["ep_shard"].size()
    tp = tp_mesh.size() if tp_mesh is not None else 1
    split_tokens = mode == "all_to_all" and tp > 1
    return ExpertLayout(
        mode=mode,
        group=ep_mesh.get_group(),
        size=ep_mesh.size(),
        first_expert=ep_mesh.get_local_rank() * experts_per_rank,
        experts_per_rank=experts_per_rank,
        tp_group=tp_mesh.get_group() if split_tokens else None,
        tp_rank=tp_mesh.get_local_rank() if split_tokens else 0,
        tp_size=tp if split_tokens else 1,
        # Copies along ep_shard hold partial sums unless there is only one copy.
        gradient_placements=(Partial("sum") if ep_shard > 1 else Replicate(), Shard(0)),
        gradient_scale=ep_mesh.size() / tp if mode == "folded" else 1.0,
        sharded=sharded,
    )


class ExpertParallelExperts(nn.Module):
    """A Hugging Face fused experts module split by expert over the ep group: its parameters under
    the same names (``gate_up_proj``, ``down_proj``, now DTensors on the MoE mesh), its activation,
    and a forward that brings each token to its experts as ``layout`` says. It takes the HF
    module's place in its MoE block, so checkpoints and plans see the same names. Per-expert
    adapters (:mod:`expert_lora`) come along, split by expert like the weights."""

    def __init__(self, experts: nn.Module, moe_mesh: DeviceMesh, placements, layout: ExpertLayout):
        super().__init__()
        self.layout = layout
        self.takes_routing = takes_routing(experts)  # else tokens already routed (Llama 4)
        self.act_fn = getattr(experts, "act_fn", None)
        # The HF module's plain settings (GPT-OSS's clamp ``limit`` and ``alpha``, the form flags)
        # and its gate, bound to this module: the HF module (its whole weights) is not kept.
        for key, value in vars(experts).items():
            if not key.startswith("_") and isinstance(value, int | float | bool | str):
                setattr(self, key, value)
        if hasattr(type(experts), "_apply_gate"):
            self._apply_gate = types.MethodType(type(experts)._apply_gate, self)
        names = _names(experts)
        for name, full in experts.named_parameters(recurse=False):  # in the source's order
            if name in names:
                self.register_parameter(name, _distributed(full, moe_mesh, placements))
        if has_expert_adapters(experts):  # split by expert like the weights, whole on ep_shard
            self.lora_scaling, self.lora_seed = experts.lora_scaling, experts.lora_seed
            for adapter in ADAPTERS:
                whole = getattr(experts, adapter).items()
                split = {n: _distributed(p, moe_mesh, (Replicate(), Shard(0))) for n, p in whole}
                self.register_module(adapter, nn.ParameterDict(split))
        exclude_from_tp_replica_sync(self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if top_k_index is None:  # tokens already routed (Llama 4)
            return _routed_forward(self, hidden_states)
        forward = _folded_forward if self.layout.mode == "folded" else _dispatched_forward
        return forward(self, hidden_states, top_k_index, top_k_weights)


def _distributed(full: nn.Parameter, mesh: DeviceMesh, placements) -> nn.Parameter:
    sharded = distribute_tensor(full.data, mesh, placements)
    return nn.Parameter(sharded, requires_grad=full.requires_grad)


def apply_expert_parallel(
    model: nn.Module,
    moe_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    patterns: list[str],
    shard_experts: bool = False,
) -> list[str]:
    """Split every experts module matched by ``patterns`` by expert over ``moe_mesh["ep"]``: each
    becomes an :class:`ExpertParallelExperts` dispatching as :func:`dispatch_mode` picks; return
    their names.

    ``tp_mesh`` is the TP mesh whose ranks share tokens (None: tp = 1). ``shard_experts`` (off by
    default) also shards each expert's weights over
    ``ep_shard`` (``Shard(1)``: the rows of ``gate_up_proj`` and ``down_proj``), FSDP-style:
    weights, gradients and optimizer state cost 1/ep_shard per rank; each forward all-gathers the
    rank's experts over ``ep_shard`` and its backward reduce-scatters their gradients (the gathered
    copy lives from a layer's forward to its backward). Works on a model with real weights (each
    rank keeps its slice) or on the meta device (load afterwards with ``materialize_pretrained``).
    With ``ep == 1`` nothing changes: every rank holds every expert, computes it on the same tokens,
    and the experts are ordinary TP replicas (mean); transformers' own experts forward then runs
    (its default is grouped_mm too), or with adapters :func:`run_whole_experts`.
    """
    ep = moe_mesh["ep"].size()
    if ep == 1:
        return []
    mode = dispatch_mode(tp_mesh.size() if tp_mesh is not None else 1, ep)
    names = expert_modules(model, patterns)
    shard_over_copies = shard_experts and moe_mesh["ep_shard"].size() > 1
    placements = [Shard(1) if shard_over_copies else Replicate(), Shard(0)]
    for name in names:
        experts = model.get_submodule(name)
        per_rank = experts.gate_up_proj.shape[0] // ep
        layout = expert_layout(moe_mesh, tp_mesh, per_rank, mode, sharded=shard_over_copies)
        parent, _, child = name.rpartition(".")
        wrapped = ExpertParallelExperts(experts, moe_mesh, placements, layout)
        model.get_submodule(parent).register_module(child, wrapped)
    return names
