"""Context parallelism: each sequence split over the ``cp`` ranks, attention over the whole of it.

It owns the zig-zag split (:func:`zigzag_indices`: ``2·cp`` chunks, rank ``r`` takes chunks ``r``
and ``2·cp-1-r``, so every rank has the same causal attention work), one micro-batch's share of a
rank (:class:`CpShard`: its tokens, its targets shifted *before* the split, its position ids, and
the attention mask built from global positions and document ids, so packed documents never attend
across their boundaries, also when one spans two ranks), and the exchange: keys and values are
all-gathered over the cp group (the backward is a reduce-scatter), then plain SDPA runs on this
rank's queries. The attention function is registered with transformers' ``AttentionInterface`` as
``context_parallel``; :func:`enable_context_parallel` makes a model use it. Plain torch collectives:
gloo and NCCL alike.

Design notes (all-gather against a ring, what is measured): docs/design-notes.md
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.distributed.collectives import all_gather_single, reduce_scatter_single

ATTENTION = "context_parallel"
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


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: which document of its row each position is in; a document starts where the
    positions do not go on by one (packed rows restart them at each example)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(1)


@dataclass(frozen=True, kw_only=True)
class CpShard:
    """One micro-batch as this cp rank computes it: [batch, seq / cp] each, and the mask [batch, 1,
    seq / cp, seq] of its queries over the keys in the order the all-gather lays them out."""

    input_ids: torch.Tensor
    targets: torch.Tensor  # already shifted: position t is trained to predict targets[t]
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    group: dist.ProcessGroup

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward: a 4D mask is used as given by transformers,
        and ``cp_group`` reaches :func:`context_parallel_attention` through the layers' kwargs."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "cp_group": self.group,
        }


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
        documents = document_ids(position_ids)
        causal = keys[None, :] <= local[:, None]
        same_document = documents[:, local, None] == documents[:, None, keys]
        return CpShard(
            input_ids=input_ids[:, local],
            targets=targets[:, local],
            position_ids=position_ids[:, local],
            attention_mask=(causal[None] & same_document)[:, None],
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
    cp_group: dist.ProcessGroup | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention on this rank's queries over every cp rank's keys and values
    (gathered when ``cp_group`` is given; without it, plain SDPA). ``attention_mask``: the
    :class:`CpShard`'s."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cp_group is not None:
        key, value = gather_sequence(key, cp_group), gather_sequence(value, cp_group)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def enable_context_parallel(model: nn.Module) -> None:
    """Register :func:`context_parallel_attention` (again: the same entry) and make ``model``'s
    attention layers call it. Its mask function is SDPA's: a forward without a :class:`CpShard`
    (no ``cp_group``) is plain SDPA with the mask transformers builds, packed rows included.
    transformers is imported here, not with the module: the recipe's start stays that of torch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
