"""Load balance of MoE experts: the tokens per expert imbalance of each step, and the router's
auxiliary loss.

Imbalance: tokens per expert, max / mean, per MoE layer, the worst layer reported. A forward
pre-hook on each experts module counts the expert choices of real tokens only
(:meth:`ExpertLoad.count_real`) while gradients are enabled; :meth:`ExpertLoad.end_step` sums
them over the dp group, and :func:`load_metrics` turns them into each layer's imbalance and each
expert's share of its layer.

Auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2), off by default:
:class:`RoutingBias` adds a per-expert bias to each router's probabilities for the top-k selection
only (a forward hook), moved at each step's end by ``rate`` against its expert's load. The bias is
a persistent buffer of the router: in the DCP checkpoint, so a resume routes exactly as the
uninterrupted run; not in an HF export (``_keys_to_ignore_on_save``). The auxiliary loss:
:func:`load_balancing_loss`, over the real tokens. Notes: docs/design-notes.md
"""

import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from components.moe.expert_parallel import expert_modules
from components.moe.structure import experts_count, takes_routing


def load_balancing_loss(
    model: nn.Module, outputs, real: torch.Tensor | None
) -> torch.Tensor | None:
    """The load-balancing loss of ``model``'s forward (``outputs``) over its real tokens
    (``real``: [rows, positions], False on the padding), as Hugging Face computes it given the
    batch's attention mask: the model's own ``load_balancing_loss_func`` (its modeling module's)
    on the router logits its config asks it to return. The recipes pass the model no mask (it
    would hide packed examples' boundaries), so its own ``aux_loss`` counts the padding, whose
    amount changes with the layout (sp pads to tp × 8). None where the forward returns no loss;
    its own ``aux_loss`` where ``real`` is None or its module has no such function."""
    own = getattr(outputs, "aux_loss", None)
    logits = getattr(outputs, "router_logits", None)
    compute = _loss_function(model)
    if own is None or real is None or not isinstance(logits, tuple) or compute is None:
        return own
    if logits[0].shape[0] != real.numel():
        raise RuntimeError(
            f"load-balancing loss: {logits[0].shape[0]} tokens were routed but the real-token "
            f"mask has {real.numel()} positions"
        )
    return compute(logits, model.num_experts, model.num_experts_per_tok, real)


def _loss_function(model: nn.Module):
    """The ``load_balancing_loss_func`` of the module that defines ``model``'s class (FSDP's
    wrapper class looked through), for a model that names its ``num_experts`` and
    ``num_experts_per_tok`` as Hugging Face's MoE causal LMs do; None otherwise."""
    if not (hasattr(model, "num_experts") and hasattr(model, "num_experts_per_tok")):
        return None
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and hasattr(module, "load_balancing_loss_func"):
            return module.load_balancing_loss_func
    return None


def router_aux_loss_weight(config, micro_batches: int, dp: int) -> float:
    """The weight of the model's load-balancing loss in each micro-batch's backward: its config's
    ``router_aux_loss_coef`` spread over the step's micro-batches and dp ranks, so the dp sum of
    gradients is the coefficient times the mean auxiliary loss (as Hugging Face adds it to a batch's
    loss); 0 unless the config sets ``output_router_logits``. Under TP the loss is the same on every
    rank, like the router."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return config.router_aux_loss_coef / (micro_batches * dp)


class RoutingBias:
    """DeepSeek-V3's per-expert routing bias on every router ``patterns`` match (see the module
    docstring); ``update`` once per step with the layers' token counts, in the routers' order."""

    BUFFER = "routing_bias"

    def __init__(self, model: nn.Module, patterns: list[str], num_experts: int, rate: float = 1e-3):
        self.rate = rate
        self.names = expert_modules(model, patterns)
        self.routers = [model.get_submodule(name) for name in self.names]
        for router in self.routers:
            if router.weight.device.type == "meta":
                raise ValueError("a routing bias goes on a materialised model, not on meta")
            bias = torch.zeros(num_experts, dtype=torch.float32, device=router.weight.device)
            router.register_buffer(self.BUFFER, bias)  # persistent: checkpointed with the model
            router.register_forward_hook(_choose_with_bias)
        ignored = [f"{name}.{self.BUFFER}" for name in self.names]
        already = getattr(model, "_keys_to_ignore_on_save", None) or ()
        model._keys_to_ignore_on_save = [*already, *ignored]  # left out of an HF export

    def update(self, counts: torch.Tensor) -> None:
        """Move each bias by ``rate`` toward its layer's mean load; counts: layers x experts."""
        load = counts.to(torch.float32)
        step = self.rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
        for router, change in zip(self.routers, step, strict=True):
            router.routing_bias.add_(change.to(router.routing_bias.device))


def _choose_with_bias(router: nn.Module, args: tuple, output: tuple) -> tuple:
    """A router's forward hook: its top-k chosen again on ``probabilities + routing_bias``; the
    weights are the unbiased probabilities of the chosen experts, normalised as the router does
    (Mixtral always, Qwen3-MoE under ``norm_topk_prob``)."""
    logits, scores, _ = output
    probabilities = F.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probabilities + router.routing_bias, router.top_k, dim=-1).indices
    weights = probabilities.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(scores.dtype), chosen


def _count_hook(model: nn.Module, name: str, router: str | None, count):
    """Call ``count(module, (hidden, choices))`` with the expert choices of the experts ``name``:
    from their arguments when they take the routing, else (Llama 4's, handed rows already routed)
    from their block's ``router``: its top-k scores' experts."""
    experts = model.get_submodule(name)
    if takes_routing(experts):
        return experts.register_forward_pre_hook(count)

    def from_router(module: nn.Module, args: tuple, output) -> None:
        scores = output[0] if isinstance(output, tuple) else output
        count(module, (None, torch.topk(scores.detach(), module.top_k, dim=-1).indices))

    return model.get_submodule(router).register_forward_hook(from_router)


def _block_routers(model: nn.Module, routers: tuple[str, ...]) -> dict[str, str]:
    """The first router (of ``routers``) in each block, by the block's name: one scan."""
    found: dict[str, str] = {}
    for router in expert_modules(model, list(routers)):
        found.setdefault(router.rpartition(".")[0], router)
    return found


def uncounted_experts(model: nn.Module, patterns: list[str], routers: tuple[str, ...]) -> list[str]:
    """The experts modules whose choices cannot be counted: handed tokens already routed, with no
    router found beside them (JetMoE's ``input_linear``, called with per-expert token counts):
    their layers have no ``expert_load`` and count in no ``expert_imbalance``."""
    beside = _block_routers(model, routers)
    return [name for name in expert_modules(model, patterns) if not _counted(model, name, beside)]


def _counted(model: nn.Module, name: str, beside: dict[str, str]) -> bool:
    """Whether the experts ``name``'s choices can be counted: they take the routing, or a router
    sits in their block (``beside``: :func:`_block_routers`)."""
    return takes_routing(model.get_submodule(name)) or name.rpartition(".")[0] in beside


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since the last :meth:`end_step`."""

    def __init__(
        self,
        model: nn.Module,
        patterns: list[str],
        num_experts: int,
        dp_group: dist.ProcessGroup | None,
        bias: RoutingBias | None = None,
        routers: tuple[str, ...] = (),
    ):
        beside = _block_routers(model, routers)  # one scan for the counted and their hooks
        names = [name for name in expert_modules(model, patterns) if _counted(model, name, beside)]
        blocks = [name.rpartition(".")[0] for name in names]
        if bias is not None and [name.rpartition(".")[0] for name in bias.names] != blocks:
            raise ValueError(f"routers {bias.names} are not one per experts module {names}")
        self.bias = bias  # updated from each step's counts
        self.dp_group = dp_group
        self.counts = torch.zeros(len(names), num_experts, dtype=torch.int64)
        self.real: torch.Tensor | None = (
            None  # flat real-token mask of the micro-batch being run; None: all
        )
        self.handles = [
            _count_hook(model, name, beside.get(block), partial(self._count, row))
            for row, (name, block) in enumerate(zip(names, blocks, strict=True))
        ]

    @classmethod
    def watch(
        cls, model: nn.Module, config, patterns: list[str], dp_group, routers=(), bias_rate=0.0
    ) -> "ExpertLoad | None":
        """Count the expert choices of ``model`` (None for a model without experts). ``bias_rate``
        > 0 also balances the ``routers`` without an auxiliary loss (:class:`RoutingBias`)."""
        names = expert_modules(model, patterns)
        if not names or len(uncounted_experts(model, patterns, routers)) == len(names):
            return None  # dense, or no choices to count
        num_experts = experts_count(model.get_submodule(names[0]))  # any family's, from structure
        bias = RoutingBias(model, list(routers), num_experts, bias_rate) if bias_rate > 0 else None
        return cls(model, patterns, num_experts, dp_group, bias, tuple(routers))

    def count_real(self, mask: torch.Tensor) -> None:
        """Count only the positions where ``mask`` ([rows, seq_len], the next micro-batch's) is
        True."""
        self.real = mask.reshape(-1)

    def _count(self, row: int, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            choices = args[1]  # [tokens, top_k]
            if (
                self.counts.device != choices.device
            ):  # once: the counts live where the routing runs (no sync)
                self.counts = self.counts.to(choices.device)
            if self.real is None:
                weights = torch.ones_like(choices)
            elif len(choices) != len(self.real):
                raise RuntimeError(
                    f"expert load: {len(choices)} tokens were routed but the real-token mask has "
                    f"{len(self.real)} positions"
                )
            # a 0/1 weight per choice, not a boolean index (which would make a GPU wait for its
            # size)
            else:
                weights = self.real.to(choices.dtype).unsqueeze(1).expand_as(choices)
            # index_add_, not bincount: bincount sizes its output from the largest id, a GPU-to-host
            # sync
            self.counts[row].index_add_(0, choices.reshape(-1), weights.reshape(-1))

    def end_step(self) -> torch.Tensor:
        """The step's end: its counts (layers x experts), summed over the dp group, are returned and
        reset, and the routing bias (if any) moves by them. A collective over the dp group: every
        rank calls it once per step."""
        counts = self.counts.clone()
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(counts, group=self.dp_group)
        self.counts.zero_()
        if self.bias is not None:
            self.bias.update(counts)
        return counts


def load_metrics(counts: torch.Tensor | list[list[float]], per_expert: bool = False) -> dict:
    """A step's load (:meth:`ExpertLoad.end_step`, or its rows as read with the step's other
    values) for the trackers: ``expert_imbalance`` (the worst layer's max / mean tokens per
    expert), ``expert_imbalance/layer_N`` per layer, and with ``per_expert`` each expert's share
    ``expert_load/layer_N/expert_E``. Whole token counts: float64 sums are exact, in any order."""
    rows = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    layers = [max(row) / max(sum(row) / len(row), 1e-12) for row in rows]
    record = {"expert_imbalance": max(layers, default=1.0)}
    record |= {f"expert_imbalance/layer_{n}": value for n, value in enumerate(layers)}
    if per_expert:
        for n, row in enumerate(rows):
            total = max(sum(row), 1.0)
            record |= {f"expert_load/layer_{n}/expert_{e}": x / total for e, x in enumerate(row)}
    return record
