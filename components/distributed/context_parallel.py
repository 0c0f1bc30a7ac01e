"""Context parallelism: each sequence split over the ``cp`` ranks, attention over the whole of it.

It owns the zig-zag split (:func:`zigzag_indices`: ``2·cp`` chunks, rank ``r`` takes chunks ``r``
and ``2·cp-1-r``, so every rank has the same causal attention work), one micro-batch's share of a
rank (:class:`CpShard`: its tokens, its targets shifted *before* the split, its position ids, and
where its queries and the gathered keys sit in the whole sequence), and the exchange: keys and
values are all-gathered over the cp group (the backward is a reduce-scatter), then SDPA (or the
model's own eager attention, for softcapping and sinks) runs on this rank's queries. Each layer's
mask is transformers' own: the mask function ``create_masks_for_generate`` picks for the layer's
type (full, sliding window, chunked, packed documents kept apart), evaluated at the global
positions of this rank's queries and keys (:class:`CpLayout`); what it cannot express is refused
before a run starts (:func:`attention_problems`). The attention function is registered with
transformers' ``AttentionInterface`` as ``context_parallel``; :func:`enable_context_parallel` makes
a model use it. Plain torch collectives: gloo and NCCL alike. Design notes: docs/design-notes.md
"""

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_masks_for_generate, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from components.distributed.collectives import all_gather_single, reduce_scatter_single

ATTENTION = "context_parallel"
MASK_FUNCTION = "context_parallel_mask_function"  # a mask "interface" that returns the function
IGNORE_INDEX = -100


def zigzag_indices(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The positions of the sequence rank ``rank`` of ``size`` holds, in its local order: chunk
    ``rank`` then chunk ``2·size-1-rank`` of ``2·size`` equal chunks.

    Raises:
        ValueError: If ``seq_len`` is not divisible by ``2·size``.
    """
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 × cp ({2 * size})")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def _return_mask_function(*, mask_function: Callable, **_) -> Callable:
    return mask_function


def layer_mask_functions(config, position_ids: torch.Tensor) -> Callable | dict | None:
    """transformers' mask function for whole rows with these position ids: one per layer type
    (a dict) when the config has ``layer_types``, else one for every layer; None (or a None
    value) where transformers builds no attention mask (linear attention, unknown layer types).
    ``create_masks_for_generate`` chooses as the model does; its mask "interface" here hands the
    composed function back instead of a mask."""
    AttentionMaskInterface.register(MASK_FUNCTION, _return_mask_function)
    probe = copy.copy(config.get_text_config())
    probe._attn_implementation_internal = MASK_FUNCTION  # this copy only, not its sub-configs
    batch, seq = position_ids.shape
    embeds = position_ids.new_empty((batch, seq, 0), dtype=torch.float32)
    return create_masks_for_generate(probe, embeds, None, None, position_ids)


def _layer_type(config, layer_idx: int) -> str | None:
    layer_types = getattr(config, "layer_types", None)
    return None if layer_types is None else layer_types[layer_idx]


@dataclass(frozen=True, kw_only=True)
class CpLayout:
    """Where this rank's queries ([seq / cp]) and the gathered keys ([seq], in all-gather order)
    sit in the whole sequence, and the whole rows' position ids: what each layer's mask is
    evaluated on. Masks [batch, 1, seq / cp, seq] are built once per model and layer type per
    forward (``masks``: by the model's config, then by layer type, None for a model without
    ``layer_types``): two models run on one shard (distillation's teacher and student) each get
    their own."""

    queries: torch.Tensor
    keys: torch.Tensor
    position_ids: torch.Tensor
    masks: dict = field(default_factory=dict)  # id(config) -> {layer type: mask}

    def mask(self, config, layer_idx: int) -> torch.Tensor:
        """The boolean mask of layer ``layer_idx`` of a model with ``config``."""
        masks = self.masks.get(id(config))
        if masks is None:  # the model's mask functions, each replaced by its mask on first use
            functions = layer_mask_functions(config, self.position_ids)
            masks = functions if isinstance(functions, dict) else {None: functions}
            self.masks[id(config)] = masks
        kind = _layer_type(config, layer_idx)
        if masks.get(kind) is None:
            raise ValueError(f"context parallelism has no mask for {kind} layers")
        if callable(masks[kind]):
            masks[kind] = self._evaluate(masks[kind])
        return masks[kind]

    def _evaluate(self, function: Callable) -> torch.Tensor:
        batch = self.position_ids.shape[0]
        batch_idx = torch.arange(batch, device=self.keys.device)[:, None, None, None]
        head_idx = torch.zeros(1, dtype=torch.long, device=self.keys.device)[None, :, None, None]
        allowed = function(
            batch_idx, head_idx, self.queries[None, None, :, None], self.keys[None, None, None, :]
        )
        return allowed.expand(batch, 1, len(self.queries), len(self.keys))


@dataclass(frozen=True, kw_only=True)
class CpShard:
    """One micro-batch as this cp rank computes it: [batch, seq / cp] each, and its
    :class:`CpLayout`."""

    input_ids: torch.Tensor
    targets: torch.Tensor  # already shifted: position t is trained to predict targets[t]
    position_ids: torch.Tensor
    layout: CpLayout
    group: dist.ProcessGroup

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward, run inside :func:`running`; the attention
        mask is a 4D placeholder, which transformers passes on as given (each layer builds its
        own)."""
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.input_ids.device)
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": placeholder,
        }


# The shard whose forward and backward are running: a module global, not a context variable, so
# that activations recomputed in the backward on an autograd device thread see it too.
_RUNNING: list[CpShard] = []


@contextmanager
def running(shard: CpShard | None) -> Iterator[None]:
    """Run ``shard``'s forward and backward in this block (None: no cp, nothing to do). Raises
    RuntimeError if no attention layer computed it: the model's attention does not go through
    transformers' attention interface, and each rank would have attended to its own tokens."""
    if shard is None:
        yield
        return
    _RUNNING.append(shard)
    try:
        yield
    finally:
        _RUNNING.pop()
    if not shard.layout.masks:  # filled by the first layer that computed the shard
        raise RuntimeError(
            "context parallelism: no attention layer of the model went through transformers' "
            "attention interface, so no rank saw the others' keys"
        )


@dataclass(frozen=True, kw_only=True)
class ContextParallel:
    """This rank's place in its cp group."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> "ContextParallel | None":
        """The cp group of ``mesh`` (its ``cp`` dimension); None without one of size > 1."""
        if mesh is None or "cp" not in (mesh.mesh_dim_names or ()) or mesh["cp"].size() == 1:
            return None
        cp = mesh["cp"]
        return cls(group=cp.get_group(), rank=cp.get_local_rank(), size=cp.size())

    def shard(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor
    ) -> CpShard:
        """This rank's share of a whole micro-batch (every cp rank holds all of it): labels are
        shifted over the whole sequence first, so a chunk's last token keeps its target."""
        seq_len = input_ids.shape[1]
        local = zigzag_indices(seq_len, self.rank, self.size, input_ids.device)
        keys = torch.cat(
            [zigzag_indices(seq_len, r, self.size, input_ids.device) for r in range(self.size)]
        )
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return CpShard(
            input_ids=input_ids[:, local],
            targets=targets[:, local],
            position_ids=position_ids[:, local],
            layout=CpLayout(queries=local, keys=keys, position_ids=position_ids),
            group=self.group,
        )


class _GatherSequence(torch.autograd.Function):
    """[batch, heads, n, dim] on each of ``size`` ranks -> [batch, heads, size·n, dim], rank by
    rank; the backward sums each rank's slice of the gradient over the group (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group, size):
        ctx.group, ctx.size = group, size
        batch, heads, n, dim = tensor.shape
        gathered = tensor.new_empty((size * batch, heads, n, dim))  # rank-major on dim 0
        all_gather_single(gathered, tensor.contiguous(), group=group)
        gathered = gathered.view(size, batch, heads, n, dim).permute(1, 2, 0, 3, 4)
        return gathered.reshape(batch, heads, size * n, dim)

    @staticmethod
    def backward(ctx, grad):
        batch, heads, total, dim = grad.shape
        size = ctx.size
        pieces = grad.reshape(batch, heads, size, total // size, dim).permute(2, 0, 1, 3, 4)
        local = grad.new_empty((batch, heads, total // size, dim))
        reduce_scatter_single(
            local, pieces.reshape(size * batch, *local.shape[1:]), group=ctx.group
        )
        return local, None, None


def gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every cp rank's ``tensor`` [batch, heads, n, dim] laid end to end on the sequence dim, in
    rank order (autograd-correct)."""
    return _GatherSequence.apply(tensor, group, dist.get_world_size(group))


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's queries over every cp rank's keys and values (gathered while a shard is
    :func:`running`, with this layer's mask from its layout; without one, the mask transformers
    built). SDPA, or the model's own eager attention where the layer asks for what SDPA cannot do:
    logit softcapping (``softcap``, Gemma 2) or attention sinks (``s_aux``, GPT-OSS)."""
    if _RUNNING:
        shard = _RUNNING[-1]
        key, value = gather_sequence(key, shard.group), gather_sequence(value, shard.group)
        attention_mask = shard.layout.mask(module.config, module.layer_idx)
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds a bias
        bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        attention_mask = bias.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, **kwargs)


def _uses_attention_interface(config) -> bool:
    """Whether the causal LM class of ``config`` computes attention through transformers'
    attention interface: its modeling module reads ``ALL_ATTENTION_FUNCTIONS`` (GPT-J's and XGLM's
    do not). A config no causal LM class maps to: True (the model is refused elsewhere)."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return model_class is None or hasattr(
        sys.modules[model_class.__module__], "ALL_ATTENTION_FUNCTIONS"
    )


def attention_problems(config, cp: int) -> list[str]:
    """What context parallelism (``cp`` > 1) cannot run of this model's attention, one message
    each: attention that does not go through transformers' attention interface (GPT-J, XGLM), layers
    transformers builds no attention mask for (linear attention, unknown layer types) and the
    bidirectional overlay of ``use_bidirectional_attention``, which its mask functions do not
    describe."""
    if cp == 1:
        return []
    if not _uses_attention_interface(config):
        kind = config.model_type
        return [
            f"cp={cp} with model type '{kind}' is not supported: its attention does not go "
            "through transformers' attention interface, which context parallelism replaces: "
            "use cp=1"
        ]
    functions = layer_mask_functions(config, torch.arange(4)[None])
    text, found = config.get_text_config(), []
    if functions is None or isinstance(functions, dict) and None in functions.values():
        kinds = ", ".join(sorted(set(getattr(text, "layer_types", None) or ["unknown"])))
        found.append(f"a model with {kinds} layers (model.config.layer_types)")
    if getattr(text, "use_bidirectional_attention", False):
        found.append("model.config.use_bidirectional_attention=true")
    return [f"cp={cp} with {what} is not supported: use cp=1" for what in found]


def enable_context_parallel(model: nn.Module) -> None:
    """Register :func:`context_parallel_attention` (again: the same entry) and make ``model``'s
    attention layers call it. Its mask function is SDPA's: a forward without a :class:`CpShard`
    (no ``cp_group``) is plain SDPA with the mask transformers builds, packed rows included."""
    AttentionInterface.register(ATTENTION, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
