"""LoRA: low-rank adapters on a model's linear layers, the base frozen (docs/lora.md).

:func:`apply_lora` turns each targeted ``nn.Linear`` into a :class:`LoRALinear` in place (same
parameter objects and names, plus ``lora_A``/``lora_B`` children, PEFT's names and shapes) and
freezes everything else. Under tensor parallelism an adapter is placed by its base layer's style
(torchtitan's placement): colwise base -> A replicated (its gradient a partial sum over the TP
ranks: marked ``"sum"``), B sharded by rows; rowwise base -> A sharded by columns, B replicated
with identical gradients (``"mean"``), added after the base's reduction.
"""

import fnmatch
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from components.distributed.tp_replicas import mark_tp_replica_gradient_reduction

ADAPTERS = ("lora_A", "lora_B")
TP_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """``peft.*`` as the model sees it: the update is ``alpha / rank · B·A`` on ``dropout(x)``."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]  # fnmatch patterns of module names ("*" for a layer index)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if self._tp is None:
            return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        mesh, style, output_layouts = self._tp
        if style == "colwise":  # x replicated: h whole on every rank, y this rank's output columns
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
        mark_tp_replica_gradient_reduction(replicated, "sum" if style == "colwise" else "mean")
        self._tp = (mesh, style, tuple(getattr(torch_style, "output_layouts", (Replicate(),))))

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """PEFT's init, drawn from this adapter's own seed (the same on every rank): A
        kaiming-uniform (bound 1/sqrt(in_features)), B zeros; each rank keeps its part."""
        A, B = self.lora_A.weight, self.lora_B.weight
        generator = torch.Generator().manual_seed(self.lora_seed)
        bound = 1.0 / math.sqrt(A.shape[1])
        full = torch.empty(tuple(A.shape)).uniform_(-bound, bound, generator=generator)
        _copy_local(A, full)
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


def targeted_linears(model: nn.Module, patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(names of the linear layers ``patterns`` match, problems): a matched module that is not an
    ``nn.Linear`` is a problem, and so is no match at all."""
    names, problems = [], []
    for name, module in model.named_modules():
        if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            if type(module) in (nn.Linear, LoRALinear):
                names.append(name)
            else:
                problems.append(
                    f"peft.target_modules matches {name}, a {type(module).__name__}, "
                    "not a linear layer: narrow the pattern"
                )
    if not names and not problems:
        problems.append(
            f"peft.target_modules {list(patterns)} match no linear layer of "
            f"{type(model).__name__}: give module name patterns, e.g. '*.q_proj'"
        )
    return names, problems


def apply_lora(model: nn.Module, options: LoraOptions, seed: int) -> list[str]:
    """Freeze ``model`` and give each targeted linear an adapter (``options``), in place; return
    the adapted module names. Adapters on the meta device are initialised when the weights load
    (:func:`reset_adapters`).

    Raises:
        ValueError: If the patterns match no linear layer, or match another kind of module.
    """
    names, problems = targeted_linears(model, options.target_modules)
    if problems:
        raise ValueError("; ".join(problems))
    model.requires_grad_(False)
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


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter (not in a base checkpoint)."""
    return any(f".{adapter}." in f".{name}" for adapter in ADAPTERS)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The adapted linear layers of ``model`` by name, sorted."""
    return sorted((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def adapter_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter's whole weight as ``dtype`` under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``). Collective when any is a DTensor: every rank
    calls it and gets the same tensors."""
    state = {}
    for name, module in lora_modules(model):
        for adapter in ADAPTERS:
            weight = getattr(module, adapter).weight.detach()
            whole = weight.full_tensor() if isinstance(weight, DTensor) else weight
            state[f"base_model.model.{name}.{adapter}.weight"] = whole.to(dtype).contiguous()
    return state


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold each adapter into its base weight (``W += scaling · B·A``) and zero its B: the model
    computes the same function, its base weights are the merged ones, and an export leaves the
    adapters out (HF's ``_keys_to_ignore_on_save``). Collective like
    :func:`adapter_state`; the base may be sharded by TP and FSDP."""
    for _, module in lora_modules(model):
        A, B = (getattr(module, adapter).weight.detach() for adapter in ADAPTERS)
        A, B = (w.full_tensor() if isinstance(w, DTensor) else w for w in (A, B))
        delta = (B.float() @ A.float()) * module.scaling
        weight = module.weight
        if isinstance(weight, DTensor):
            mesh, placements = weight.device_mesh, weight.placements
            delta = distribute_tensor(delta, mesh, placements, src_data_rank=None).to_local()
            weight = weight.to_local()
        weight.copy_((weight.float() + delta).to(weight.dtype))
        _local(module.lora_B.weight).zero_()
    ignored = list(getattr(model, "_keys_to_ignore_on_save", None) or ())
    adapters = [name for name, _ in model.named_parameters() if is_adapter(name)]
    model._keys_to_ignore_on_save = ignored + adapters  # as save_pretrained: not exported


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
