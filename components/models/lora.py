"""LoRA: low-rank adapters on a model's linear layers, the base frozen (docs/lora.md).

:func:`apply_lora` turns each targeted ``nn.Linear`` into a :class:`LoRALinear` in place (same
parameter objects and names, plus ``lora_A``/``lora_B`` children, PEFT's names and shapes) and
freezes everything else. Under tensor parallelism an adapter is placed by its base layer's style
(torchtitan's placement): colwise base -> A replicated (its gradient a partial sum over the TP
ranks: marked ``"sum"``), B sharded by rows; rowwise base -> A sharded by columns, B replicated
with identical gradients (``"mean"``), added after the base's reduction. With
``LoraOptions.experts`` each matched MoE experts module becomes a :class:`LoRAExperts`: per-expert
adapters on its fused 3-D weights (``components/moe/expert_lora.py``), split by expert parallelism
like the experts, TP replicas (``"mean"``) like them at ep=1, exported in PEFT's
``target_parameters`` layout.
"""

import fnmatch
import functools
import logging
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from components.distributed.chunked_loss import HeadAdapter
from components.distributed.tp_replicas import mark_tp_replica_gradient_reduction
from components.moe.expert_lora import ADAPTED_WEIGHTS, ADAPTERS, has_expert_adapters
from components.moe.expert_parallel import expert_modules, experts_problem, run_whole_experts

_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")

# The TP styles that split a linear's output features (B by rows, as the weight): colwise, and the
# vocab-parallel head's (whose B then follows the vocabulary split); rowwise splits the input.
COLWISE_STYLES = ("colwise", "vocab_parallel", "colwise_gather_output")
TP_STYLES = (*COLWISE_STYLES, "rowwise")
# peft.target_modules=null: the attention and MLP projections, each where the model has one (the
# sparse MLPs of an MoE model have none: their experts take adapters with peft.experts=true)
PROJECTIONS = tuple(f"*.self_attn.{name}_proj" for name in "qkvo") + tuple(
    f"*.mlp.{name}_proj" for name in ("gate", "up", "down")
)


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """``peft.*`` as the model sees it: the update is ``alpha / rank · B·A`` on ``dropout(x)``."""

    rank: int
    alpha: float
    dropout: float
    # fnmatch patterns of module names ("*" for a layer index), each matching; None: PROJECTIONS
    target_modules: tuple[str, ...] | None
    experts: tuple[str, ...] = ()  # patterns of MoE experts modules given per-expert adapters

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose output adds ``scaling · lora_B(lora_A(dropout(x)))`` (PEFT's
    order). Made from a built linear by :func:`apply_lora`; its own weight and bias stay frozen."""

    tp_styles = TP_STYLES  # the base styles an adapter can be placed by (read by the TP plan)
    lora_seed: int
    scaling: float
    _tp: tuple[DeviceMesh, str, tuple] | None  # (mesh, base style, output layouts) once TP'd
    adapter_on = True  # False within adapters_off(): the base layer alone

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base layer's output (QLoRA's NF4 base overrides it)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_output(x)
        if not self.adapter_on:  # the TP style's hooks place the base's output, as a plain layer's
            return base
        if self._tp is None:
            return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        mesh, style, output_layouts = self._tp
        if style != "rowwise":  # x replicated: h whole on every rank, y this rank's output columns
            local_x = x.to_local(grad_placements=(Partial(),)) if isinstance(x, DTensor) else x
            h = F.linear(self.lora_dropout(local_x), self.lora_A.weight)
            y = F.linear(h, self.lora_B.weight.to_local()) * self.scaling
            return base + DTensor.from_local(y, mesh, (Shard(-1),), run_check=False)
        # rowwise: x sharded on features; h = A·x is a partial sum, reduced before the replicated B
        partial = F.linear(self.lora_dropout(x.to_local()), self.lora_A.weight.to_local())
        h = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
        h = h.redistribute(mesh, (Replicate(),)).to_local()
        y = DTensor.from_local(self.lora_B(h) * self.scaling, mesh, (Replicate(),), run_check=False)
        return base.redistribute(mesh, output_layouts) + y.redistribute(mesh, output_layouts)

    def parallelize_tp(self, mesh: DeviceMesh, style: str, torch_style: ParallelStyle) -> None:
        """Shard the base with ``torch_style`` (its own weight and bias only), then place the
        adapters by ``style`` (see the module docstring)."""
        if style not in TP_STYLES:
            raise ValueError(f"LoRA on a {style!r} layer is not supported: only {TP_STYLES}")
        adapters = {name: self._modules.pop(name) for name in (*ADAPTERS, "lora_dropout")}
        parallelize_module(self, mesh, torch_style)  # sees weight and bias alone
        self._modules.update(adapters)
        sharded, replicated = (self.lora_B, self.lora_A)
        placement = Shard(0)
        if style == "rowwise":
            sharded, replicated, placement = self.lora_A, self.lora_B, Shard(1)
        weight = distribute_tensor(sharded.weight.detach(), mesh, (placement,), src_data_rank=None)
        sharded.weight = nn.Parameter(weight)
        mark_tp_replica_gradient_reduction(replicated, "mean" if style == "rowwise" else "sum")
        self._tp = (mesh, style, tuple(getattr(torch_style, "output_layouts", (Replicate(),))))

    def head_adapter(self) -> HeadAdapter | None:
        """The adapter's update as the chunked loss computes a head's (``lm_head``'s), chunk by
        chunk with the base weight; None when split rowwise (no head is) or switched off (the
        base alone: :func:`~components.distributed.chunked_loss.head_weights` reads
        ``adapter_on``)."""
        if (self._tp is not None and self._tp[1] == "rowwise") or not self.adapter_on:
            return None
        A, B = self.lora_A.weight, self.lora_B.weight
        return HeadAdapter(A=A, B=B, scaling=self.scaling, dropout=self.lora_dropout)

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """PEFT's init, drawn from this adapter's own seed (the same on every rank): A
        kaiming-uniform (bound 1/sqrt(in_features)), B zeros; each rank keeps its part."""
        _init_adapter(self.lora_A.weight, self.lora_B.weight, self.lora_seed)


def _init_adapter(A: torch.Tensor, B: torch.Tensor, seed: int) -> None:
    """PEFT's init from ``seed``: A kaiming-uniform (bound 1/sqrt of its last dimension, the
    input features), B zeros; each rank copies its part of the global tensors."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(A.shape[-1])
    _copy_local(A, torch.empty(tuple(A.shape)).uniform_(-bound, bound, generator=generator))
    _copy_local(B, torch.zeros(tuple(B.shape)))


def _copy_local(parameter: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the global ``full`` into ``parameter`` (a tensor or DTensor)."""
    if isinstance(parameter, DTensor):
        part = distribute_tensor(
            full, parameter.device_mesh, parameter.placements, src_data_rank=None
        )
        parameter.to_local().copy_(part.to_local())
    else:
        parameter.copy_(full)


class LoRAExperts(nn.Module):
    """A transformers 5 fused experts module (``gate_up_proj``, ``down_proj``: [E, out, in]) with
    per-expert adapters ``lora_A.<weight>`` [E, r, in] and ``lora_B.<weight>`` [E, out, r]
    (``components/moe/expert_lora.py``). Made from a built experts module by :func:`apply_lora`
    (the same parameters and names, its own weights frozen); at ep=1 its forward is a rank's
    expert-parallel one over every expert, and expert parallelism replaces it as it does any
    experts module, adapters included."""

    lora_scaling: float
    lora_seed: int

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return run_whole_experts(self, hidden_states, top_k_index, top_k_weights)


def _adapt_experts(module: nn.Module, options: LoraOptions, seed: int) -> None:
    """Give the experts ``module`` per-expert adapters, in place (see :class:`LoRAExperts`)."""
    shapes = {name: tuple(getattr(module, name).shape) for name in ADAPTED_WEIGHTS}
    weight = getattr(module, ADAPTED_WEIGHTS[0])
    empty = functools.partial(torch.empty, device=weight.device, dtype=weight.dtype)
    module.__class__ = LoRAExperts  # same parameters, same names: the weights load as before
    r = options.rank
    module.lora_A = nn.ParameterDict({n: empty(e, r, i) for n, (e, _, i) in shapes.items()})
    module.lora_B = nn.ParameterDict({n: empty(e, o, r) for n, (e, o, _) in shapes.items()})
    for adapters in (module.lora_A, module.lora_B):  # TP replicas at ep=1, as the experts
        mark_tp_replica_gradient_reduction(adapters, "mean")
    module.lora_scaling, module.lora_seed = options.scaling, seed
    if weight.device.type != "meta":
        _reset_expert_adapters(module)


@torch.no_grad()
def _reset_expert_adapters(module: nn.Module) -> None:
    """PEFT's init of each expert's adapters (as :meth:`LoRALinear.reset_adapter`), drawn from
    the module's seed and the weight's name; each rank keeps its experts' part."""
    for name in ADAPTED_WEIGHTS:
        seed = module.lora_seed ^ zlib.crc32(name.encode())
        _init_adapter(module.lora_A[name], module.lora_B[name], seed)


def targeted_experts(model: nn.Module, patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(names of the MoE experts modules ``patterns`` match, problems): an experts module whose
    form the adapters' forward does not compute is a problem (each once), and so is no match."""
    names = expert_modules(model, list(patterns))
    found: dict[str, list[str]] = {}
    unsupported = "LoRA on such experts is not supported: use peft.experts=false"
    for name in names:
        module = model.get_submodule(name)
        if (problem := experts_problem(module, unsupported, adapters=True)) is not None:
            found.setdefault(problem, []).append(name)
    problems = []
    for problem, where in found.items():
        more = f" (and {len(where) - 1} more)" if len(where) > 1 else ""
        problems.append(f"peft.experts=true: {where[0]}{more} {problem}")
    if not names:
        problems.append(
            f"peft.experts=true: the experts patterns {list(patterns)} match no module of "
            f"{type(model).__name__}"
        )
    return names, problems


def targeted_linears(
    model: nn.Module, patterns: tuple[str, ...] | None
) -> tuple[list[str], list[str]]:
    """(names of the linear layers ``patterns`` match, problems): a pattern that matches no module
    (a typo) is a problem naming it, so is a matched module that is not an ``nn.Linear``, and so
    is no linear layer at all. ``patterns`` None: :data:`PROJECTIONS`, each where the model has
    it."""
    given = patterns is not None
    patterns = patterns if given else PROJECTIONS
    names, problems, matched = [], [], set()
    for name, module in model.named_modules():
        hits = {pattern for pattern in patterns if name and fnmatch.fnmatchcase(name, pattern)}
        matched |= hits
        if hits and type(module) in (nn.Linear, LoRALinear):
            names.append(name)
        elif hits:
            problems.append(
                f"peft.target_modules matches {name}, a {type(module).__name__}, "
                "not a linear layer: narrow the pattern"
            )
    kind, examples = type(model).__name__, _example_linears(model)
    if unmatched := [pattern for pattern in patterns if given and pattern not in matched]:
        said = ", ".join(repr(pattern) for pattern in unmatched)
        one = len(unmatched) == 1
        problems.append(
            f"peft.target_modules {'pattern' if one else 'patterns'} {said} "
            f"{'matches' if one else 'match'} no module of {kind}: fix or remove "
            f"{'it' if one else 'them'} (module names such as {examples})"
        )
    elif not names and not problems:
        said = "" if given else "=null: the attention and MLP projections"
        problems.append(
            f"peft.target_modules{said} {list(patterns)} match no linear layer of {kind}: give "
            f"module name patterns (module names such as {examples})"
        )
    return names, problems


def _example_linears(model: nn.Module) -> str:
    """The first linear layer's name in ``model`` and the last's (the head), as examples."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return ", ".join(f"'{name}'" for name in (linears[:1] + linears[-1:])) or "none: no linear"


def apply_lora(model: nn.Module, options: LoraOptions, seed: int) -> list[str]:
    """Freeze ``model`` and give each targeted linear an adapter (``options``), in place; return
    the adapted module names. Adapters on the meta device are initialised when the weights load
    (:func:`reset_adapters`).

    Raises:
        ValueError: If a pattern matches no module, one matches another kind of module, or none
            matches a linear layer.
    """
    names, problems = targeted_linears(model, options.target_modules)
    experts, expert_problems = (
        targeted_experts(model, options.experts) if options.experts else ([], [])
    )
    if problems or expert_problems:
        raise ValueError("; ".join(problems + expert_problems))
    model.requires_grad_(False)
    for name in experts:
        _adapt_experts(model.get_submodule(name), options, seed ^ zlib.crc32(name.encode()))
    for name in names:
        module = model.get_submodule(name)
        device, dtype = module.weight.device, module.weight.dtype
        module.__class__ = LoRALinear  # same parameters, same names: the weights load as before
        module.lora_dropout = nn.Dropout(options.dropout) if options.dropout else nn.Identity()
        module.lora_A = nn.Linear(module.in_features, options.rank, False, device, dtype)
        module.lora_B = nn.Linear(options.rank, module.out_features, False, device, dtype)
        module.scaling, module._tp = options.scaling, None
        module.lora_seed = seed ^ zlib.crc32(name.encode())  # per adapter, the same on every rank
        if device.type != "meta":
            module.reset_adapter()
    return names


def reset_adapters(model: nn.Module) -> None:
    """Initialise every adapter of ``model`` (after a meta-device model got its storage)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_adapter()
        elif has_expert_adapters(module):
            _reset_expert_adapters(module)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every adapter switched off while the context lasts: its base model, in the
    same memory (DPO's reference under ``peft=lora``, as PEFT's ``disable_adapter()``). Adapters
    on MoE experts cannot be switched off: ValueError."""
    if lora_experts(model):
        raise ValueError("adapters on MoE experts (peft.experts=true) cannot be switched off")
    layers = [module for _, module in lora_modules(model)]
    for layer in layers:
        layer.adapter_on = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.adapter_on = True


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter (not in a base checkpoint): a
    linear's ``<module>.lora_A.weight`` or an experts module's ``<experts>.lora_A.<weight>``."""
    return any(f".{adapter}." in f".{name}" for adapter in ADAPTERS)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The adapted linear layers of ``model`` by name, sorted."""
    return sorted((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def lora_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` with per-expert adapters by name, sorted (a
    :class:`LoRAExperts`, or what expert parallelism made of one)."""
    return sorted((n, m) for n, m in model.named_modules() if has_expert_adapters(m))


def adapted_parameters(model: nn.Module) -> list[str]:
    """The expert weights that carry adapters, by full name (PEFT's ``target_parameters``)."""
    return [f"{name}.{weight}" for name, _ in lora_experts(model) for weight in ADAPTED_WEIGHTS]


def adapter_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter's whole weight as ``dtype`` under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``), expert adapters in PEFT's ``ParamWrapper``
    layout (:func:`_peft_expert_adapters`). Collective when any is a DTensor: every rank calls it
    and gets the same tensors."""
    state = {}
    for name, module in lora_modules(model):
        for adapter in ADAPTERS:
            whole = _whole(getattr(module, adapter).weight)
            state[f"base_model.model.{name}.{adapter}.weight"] = whole.to(dtype).contiguous()
    for name, module in lora_experts(model):
        state |= {key: t.to(dtype) for key, t in _peft_expert_adapters(name, module).items()}
    return state


def _peft_expert_adapters(name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """One experts module's adapters as PEFT saves ``target_parameters``: one ``ParamWrapper``
    per weight, nested in the module's registration order (the first innermost: transformers'
    ``gate_up_proj`` under ``<experts>.base_layer.``); A [E·r, in] with expert e's rows at
    e·r..e·r+r-1, B [out, r·E] with expert e's column j at j·E + e."""
    order = [n for n, _ in module.named_parameters(recurse=False) if n in ADAPTED_WEIGHTS]
    state = {}
    for index, weight in enumerate(order):
        prefix = f"base_model.model.{name}." + "base_layer." * (len(order) - 1 - index)
        A, B = _whole(module.lora_A[weight]), _whole(module.lora_B[weight])  # [E,r,in] [E,out,r]
        state[f"{prefix}lora_A.weight"] = A.reshape(-1, A.shape[-1]).contiguous()
        state[f"{prefix}lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], -1).contiguous()
    return state


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of an adapter weight, for the export. Under FSDP over TP torch logs, per rank,
    that a strided shard over a shard takes two all-gathers and "may give inconsistent results":
    a gather sums nothing, so the whole is exact, and the hint is kept out of the run's log."""
    tensor = tensor.detach()
    if not isinstance(tensor, DTensor):
        return tensor
    level = _REDISTRIBUTE_LOG.level
    _REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        _REDISTRIBUTE_LOG.setLevel(level)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold each adapter into its base weight (``W += scaling · B·A``) and zero its B: the model
    computes the same function, its base weights are the merged ones, and an export leaves the
    adapters out (HF's ``_keys_to_ignore_on_save``). Collective like
    :func:`adapter_state`; the base may be sharded by TP and FSDP."""
    for _, module in lora_modules(model):
        A, B = (_whole(getattr(module, adapter).weight) for adapter in ADAPTERS)
        _fold(module.weight, (B.float() @ A.float()) * module.scaling)
        _local(module.lora_B.weight).zero_()
    for _, module in lora_experts(model):
        for name in ADAPTED_WEIGHTS:  # W_e += scaling · B_e·A_e for every expert e
            A, B = _whole(module.lora_A[name]), _whole(module.lora_B[name])
            _fold(getattr(module, name), torch.bmm(B.float(), A.float()) * module.lora_scaling)
            _local(module.lora_B[name]).zero_()
    ignored = list(getattr(model, "_keys_to_ignore_on_save", None) or ())
    adapters = [name for name, _ in model.named_parameters() if is_adapter(name)]
    model._keys_to_ignore_on_save = ignored + adapters  # as save_pretrained: not exported


def _fold(weight: torch.Tensor, delta: torch.Tensor) -> None:
    """``weight += delta`` (the whole update, the same on every rank) on this rank's part."""
    if isinstance(weight, DTensor):
        mesh, placements = weight.device_mesh, weight.placements
        delta = distribute_tensor(delta, mesh, placements, src_data_rank=None).to_local()
        weight = weight.to_local()
    weight.copy_((weight.float() + delta).to(weight.dtype))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
