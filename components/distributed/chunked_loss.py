"""A chunked, vocab-parallel cross entropy: the output projection and the loss, a chunk of tokens at
a time, so at most one chunk's logits exist (the unchunked path, ``lm_head`` then
:func:`~components.distributed.tp_plan.cross_entropy_sum`, holds the micro-batch's fp32 logits).

Under TP each rank computes its vocabulary shard's logits (the ``Shard(0)`` ``lm_head`` weight of
the ``vocab_parallel`` style), the log-sum-exp and the target logit are combined over the TP group
with two all-reduces per chunk, and the hidden states' gradient is reduced as the head's input
layout does. Only labelled tokens take part (``-100`` ignored), shifted as ``cross_entropy_sum``
does; the same sums, in another order. The head is the one the model has: :func:`head_weights`
(the one place a wrapped head is resolved) gives its weight and, for an adapted head (LoRA's), the
adapter's update ``scaling · B·A·dropout(x)``, added to each chunk's logits (``B`` split over the
vocabulary as the weight); a head of another kind runs its own forward, unchunked.

Design notes: docs/design-notes.md
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# train.loss_chunk_tokens's default: a chunk's fp32 logits at vocab 151,936 are 0.58 GiB per rank at
# tp=1.
LOSS_CHUNK_TOKENS = 1024

# Families whose causal-LM forward applies lm_head to the decoder's last hidden states and nothing
# else (no soft-capping or scaling of the logits): the chunked head computes what their forward
# would.
PLAIN_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@dataclass(frozen=True, kw_only=True)
class HeadAdapter:
    """An adapter's update to a head's logits: ``scaling · B·A·dropout(x)`` (PEFT's order). ``A``
    [rank, hidden] whole on every TP rank; ``B`` [vocab, rank] split over the vocabulary as the
    head's weight is (a ``Shard(0)`` DTensor under vocab-parallel TP)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    dropout: nn.Module


@dataclass(frozen=True, kw_only=True)
class HeadWeights:
    """What the chunked loss multiplies the hidden states by: the head's weight, plus an adapter's
    low-rank update (None: a plain linear head)."""

    weight: torch.Tensor
    adapter: HeadAdapter | None = None


@dataclass(frozen=True, kw_only=True)
class ChunkSettings:
    """How a chunked head function runs: ``chunk`` tokens at a time; ``shard`` (group, start):
    the local weight holds vocabulary rows ``start ..`` of TP ``group``'s (None: all); logits in
    ``compute_dtype``; an adapter's ``scaling`` (None: no adapter)."""

    chunk: int
    shard: tuple[dist.ProcessGroup | None, int]
    compute_dtype: torch.dtype
    scaling: float | None


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """Log-probability of each picked token's target under ``hidden @ weight.T (+ scaling ·
    adapter_in @ B.T)``, chunk by chunk, recomputed in backward, which takes a gradient per token.
    ``picked`` [n]: the token rows that have a target; returns [n] fp32. ``weight`` (and ``B``)
    hold the vocabulary rows ``settings.shard`` says; ``adapter_in`` [tokens, rank] is the
    adapter's ``A·dropout(x)`` per token (None with ``B``: no adapter)."""

    @staticmethod
    def forward(ctx, hidden, weight, adapter_in, B, targets, picked, settings: ChunkSettings):
        (group, start), chunk = settings.shard, settings.chunk
        hidden_picked, local = (
            hidden.index_select(0, picked),
            targets.index_select(0, picked) - start,
        )
        adapter_picked = None if adapter_in is None else adapter_in.index_select(0, picked)
        lse = torch.empty(picked.numel(), dtype=torch.float32, device=hidden.device)
        logps = torch.empty_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            head = ChunkLogits(weight, adapter_picked, B, settings.scaling, settings.compute_dtype)
            for begin in range(0, picked.numel(), chunk):
                rows = slice(begin, begin + chunk)
                logits = head.logits(hidden_picked[rows], rows).float()
                target = target_logit(logits, local[rows])
                top = logits.amax(-1)
                if group is not None:
                    dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
                sums = torch.stack([logits.sub_(top[:, None]).exp_().sum(-1), target])
                if group is not None:
                    dist.all_reduce(sums, group=group)
                lse[rows] = top + sums[0].log()
                logps[rows] = sums[1] - lse[rows]
        ctx.save_for_backward(hidden_picked, weight, adapter_picked, B, local, picked, lse)
        ctx.settings, ctx.rows = settings, hidden.shape[0]
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        hidden_picked, weight, adapter_picked, B, local, picked, lse = ctx.saved_tensors
        chunk, compute_dtype = ctx.settings.chunk, ctx.settings.compute_dtype
        grads = HeadGradients(hidden_picked, weight, adapter_picked, B, ctx.needs_input_grad[1])
        with torch.autocast(hidden_picked.device.type, enabled=False):
            head = ChunkLogits(weight, adapter_picked, B, ctx.settings.scaling, compute_dtype)
            for begin in range(0, picked.numel(), chunk):
                rows = slice(begin, begin + chunk)
                h = hidden_picked[rows].to(compute_dtype)
                probs = head.logits(h, rows).float().sub_(lse[rows, None]).exp_()
                ids = local[rows]
                inside = ((ids >= 0) & (ids < probs.shape[1])).nonzero().squeeze(1)
                probs[inside, ids[inside]] -= 1  # d -logp / d logits = softmax - one-hot(target)
                grad_logits = probs.mul_(grad_logps[rows, None].neg()).to(compute_dtype)
                grads.add(head, grad_logits, h, rows)
        return (*grads.results(picked, ctx.rows), *[None] * 3)


class HeadGradients:
    """The gradients of a chunked head's inputs, accumulated chunk by chunk from the gradient of
    its logits: the picked tokens' hidden states, the weight (unless frozen: LoRA's base), and an
    adapter's ``adapter_in`` and ``B``."""

    def __init__(self, hidden_picked, weight, adapter_picked, B, needs_weight: bool):
        self.picked_hidden = torch.empty_like(hidden_picked)
        self.weight = _zeros_like(weight) if needs_weight else None
        self.adapter = None if B is None else torch.empty_like(adapter_picked)
        self.B = None if B is None else _zeros_like(B)
        self.dtypes = (weight.dtype, None if B is None else B.dtype)

    def add(
        self, head: "ChunkLogits", grad_logits: torch.Tensor, h: torch.Tensor, rows: slice
    ) -> None:
        """One chunk's ``grad_logits`` [rows, vocab shard] (``compute_dtype``) for hidden ``h``."""
        self.picked_hidden[rows] = (grad_logits @ head.w).to(self.picked_hidden.dtype)
        if self.weight is not None:
            self.weight += (grad_logits.T @ h).float()
        if self.B is not None:  # logits += scaling · adapter_in @ B.T
            grad_update = grad_logits * head.scaling
            self.adapter[rows] = (grad_update @ head.B).to(self.adapter.dtype)
            self.B += (grad_update.T @ head.adapter_in[rows]).float()

    def results(self, picked: torch.Tensor, rows: int) -> tuple:
        """(hidden, weight, adapter_in, B) gradients, the hidden ones at every token row."""
        weight_dtype, B_dtype = self.dtypes
        return (
            _scatter_rows(self.picked_hidden, picked, rows),
            None if self.weight is None else self.weight.to(weight_dtype),
            None if self.adapter is None else _scatter_rows(self.adapter, picked, rows),
            None if self.B is None else self.B.to(B_dtype),
        )


class ChunkLogits:
    """A chunk's logits in ``compute_dtype``: ``h @ weight.T``, plus ``scaling · (adapter_in @
    B.T)`` for an adapted head, as the adapter's own forward orders it."""

    def __init__(self, weight, adapter_in, B, scaling, compute_dtype):
        self.w, self.scaling = weight.to(compute_dtype), scaling
        self.B = None if B is None else B.to(compute_dtype)
        self.adapter_in = None if adapter_in is None else adapter_in.to(compute_dtype)

    def logits(self, h: torch.Tensor, rows: slice) -> torch.Tensor:
        logits = F.linear(h.to(self.w.dtype), self.w)
        if self.B is None:
            return logits
        return logits + F.linear(self.adapter_in[rows], self.B) * self.scaling


def _zeros_like(parameter: torch.Tensor) -> torch.Tensor:
    return torch.zeros(parameter.shape, dtype=torch.float32, device=parameter.device)


def _scatter_rows(picked_rows: torch.Tensor, picked: torch.Tensor, rows: int) -> torch.Tensor:
    """``picked_rows`` back at their token positions ``picked`` among ``rows``, zeros elsewhere."""
    return picked_rows.new_zeros(rows, picked_rows.shape[1]).index_copy_(0, picked, picked_rows)


def target_logit(logits: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Each row's logit at its target where this shard holds the target, else 0 (summed over
    shards)."""
    inside = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(inside, picked, torch.zeros_like(picked))


@dataclass(frozen=True, kw_only=True)
class ChunkedHead:
    """A head's inputs as the chunked functions take them, every token a row: ``hidden`` [tokens,
    hidden] (gathered under sp, its gradient reduced as the head's input layout does), the local
    ``weight`` (its vocabulary rows ``shard[1]..`` of TP group ``shard[0]``; (None, 0): all),
    an adapter's ``adapter_in`` [tokens, rank] and local ``B`` and ``scaling`` (None: no
    adapter), and the dtype the logits are computed in."""

    hidden: torch.Tensor
    weight: torch.Tensor
    adapter_in: torch.Tensor | None
    B: torch.Tensor | None
    scaling: float | None
    shard: tuple[dist.ProcessGroup | None, int]
    compute_dtype: torch.dtype

    @property
    def inputs(self) -> tuple:
        """(hidden, weight, adapter_in, B): what the autograd functions take first."""
        return (self.hidden, self.weight, self.adapter_in, self.B)

    def settings(self, chunk: int) -> ChunkSettings:
        return ChunkSettings(
            chunk=chunk, shard=self.shard, compute_dtype=self.compute_dtype, scaling=self.scaling
        )


def chunked_head(
    hidden: torch.Tensor, weight: torch.Tensor, adapter: HeadAdapter | None = None
) -> ChunkedHead:
    """The head ``hidden @ weight.T`` (plus ``adapter``'s update) prepared for the chunked
    functions: ``hidden`` [batch, seq, hidden] a tensor, or under sequence parallelism a DTensor
    sharded on the sequence (``Shard(1)``), gathered here. ``weight`` [vocab, hidden]:
    ``lm_head.weight``, a tensor or a DTensor (``Shard(0)`` over the TP mesh: vocab-parallel; tied
    to the embedding or not, its gradient goes to that one parameter). ``adapter``: an adapted
    head's update (:class:`HeadAdapter`), its ``B`` split as ``weight`` is; its dropout is drawn
    once over ``hidden``, as the head's forward draws it."""
    group, start = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.size() > 1 and weight.placements == (Shard(0),):
            if weight.shape[0] % mesh.size():
                raise ValueError(
                    f"vocab ({weight.shape[0]}) must be divisible by tp ({mesh.size()})"
                )
            group, start = (
                mesh.get_group(),
                mesh.get_local_rank() * (weight.shape[0] // mesh.size()),
            )
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    compute_dtype = (
        torch.get_autocast_dtype(device)
        if autocast
        else torch.promote_types(hidden.dtype, weight.dtype)
    )
    if autocast:  # as PrecisionPolicy.cast_tp_inputs does for lm_head: the TP collectives move bf16
        hidden = hidden.to(compute_dtype)  # (the projection would cast the same values)
    if isinstance(hidden, DTensor):  # sequence parallel: each rank needs every token
        gathered = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        grad_placements = [
            Partial() if group is not None else Replicate()
        ] * hidden.device_mesh.ndim
        hidden = gathered.to_local(grad_placements=grad_placements)
    elif group is not None:  # plain TP: the gradient is partial over vocab shards, all-reduced
        replicated = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
        hidden = replicated.to_local(grad_placements=[Partial()])
    adapter_in, B = None, None
    if adapter is not None:  # A·dropout(x) for every token (rank-wide), B split as the weight
        _check_split_alike(weight, adapter.B)
        adapter_in = F.linear(adapter.dropout(hidden), _local(adapter.A)).flatten(0, 1)
        B = _local(adapter.B)
    return ChunkedHead(
        hidden=hidden.flatten(0, 1),
        weight=_local(weight),
        adapter_in=adapter_in,
        B=B,
        scaling=None if adapter is None else adapter.scaling,
        shard=(group, start),
        compute_dtype=compute_dtype,
    )


def next_token_targets(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Each position's target, flat [batch · seq]: position t predicts ``labels[t + 1]`` (the last
    none: ``-100``), or with ``shifted`` ``labels`` as they are (a context-parallel shard's)."""
    return (labels if shifted else F.pad(labels[:, 1:], (0, 1), value=-100)).flatten()


def _check_chunk(chunk_tokens: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


def _picked_log_probs(
    head: ChunkedHead, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(picked, log-probs): the token rows with a target and their targets' log-probabilities."""
    _check_chunk(chunk_tokens)
    picked = (targets != -100).nonzero().squeeze(1)
    logps = _ChunkedHeadLogProbs.apply(*head.inputs, targets, picked, head.settings(chunk_tokens))
    return picked, logps


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    shifted: bool = False,
    adapter: HeadAdapter | None = None,
) -> torch.Tensor:
    """Sum of next-token cross entropy of ``hidden @ weight.T`` (plus ``adapter``'s update) over
    positions with a label (``-100`` ignored): what ``cross_entropy_sum(lm_head(hidden), labels)``
    computes, ``chunk_tokens`` at a time.

    ``hidden``, ``weight``, ``adapter`` as :func:`chunked_head` takes them. ``labels`` [batch, seq]
    aligned with the inputs (or with ``shifted``, each position's target already: a
    context-parallel shard's). Returns a plain scalar, the same on every TP rank. Needs no
    ``loss_parallel()``.
    """
    head = chunked_head(hidden, weight, adapter)
    _, logps = _picked_log_probs(head, next_token_targets(labels, shifted), chunk_tokens)
    total = logps[:0].sum()  # summed chunk by chunk, as the loss has always been
    for begin in range(0, logps.numel(), chunk_tokens):
        total = total + logps[begin : begin + chunk_tokens].sum()
    return -total


def chunked_token_log_probs(
    head: ChunkedHead, labels: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS
) -> torch.Tensor:
    """Each position's log-probability of its next-token label under ``head`` (the
    :func:`chunked_head` of the hidden states, the head's weight and its adapter), [batch, seq]
    fp32, 0 where there is none (``-100``): ``log_softmax`` of the logits at the label,
    ``chunk_tokens`` labelled tokens at a time, the vocabulary split over TP as the weight is (no
    rank holds the whole vocabulary's logits). Its sum over a row is the sequence's
    log-probability of its labelled tokens (DPO's). ``labels`` [batch, seq] aligned with the
    inputs; differentiable, each token's gradient its own."""
    targets = next_token_targets(labels)
    picked, logps = _picked_log_probs(head, targets, chunk_tokens)
    every = logps.new_zeros(targets.numel()).index_copy(0, picked, logps)
    return every.view(labels.shape)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _check_split_alike(weight: torch.Tensor, B: torch.Tensor) -> None:
    """An adapter's ``B`` must hold the vocabulary rows the head's weight holds on this rank."""
    split = isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    if split != (isinstance(B, DTensor) and B.placements == (Shard(0),)):
        raise ValueError(
            "the head's adapter B must be split over the vocabulary as the head's weight is: "
            f"weight {getattr(weight, 'placements', 'whole')}, "
            f"B {getattr(B, 'placements', 'whole')}"
        )


def head_weights(head: nn.Module) -> HeadWeights | None:
    """What the chunked loss computes for ``head``, the model's ``lm_head`` (the one place a
    wrapped head is resolved): a plain ``nn.Linear``'s weight; an adapted linear's weight and
    low-rank update (a linear with a ``head_adapter()`` method giving a :class:`HeadAdapter`:
    LoRA's), its weight alone while its ``adapter_on`` is False; None for any other head (a
    float8 or quantised linear, a bias): its own forward must run, unchunked. A new conversion
    that wraps the head is resolved here, or stays unchunked."""
    if getattr(head, "bias", None) is not None:
        return None
    if type(head) is nn.Linear:
        return HeadWeights(weight=head.weight)
    adapter = getattr(head, "head_adapter", None)
    if isinstance(head, nn.Linear) and callable(adapter) and (update := adapter()) is not None:
        return HeadWeights(weight=head.weight, adapter=update)
    if isinstance(head, nn.Linear) and callable(adapter) and head.adapter_on is False:
        return HeadWeights(weight=head.weight)  # the adapter switched off: the base alone
    return None


def chunks_head(model: nn.Module) -> bool:
    """Whether the chunked head applies to ``model``: a family whose forward is the decoder, then a
    bias-free ``lm_head`` (``PLAIN_HEAD_FAMILIES``) that :func:`head_weights` resolves; other
    models keep the unchunked path."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    return (
        isinstance(head, nn.Module)
        and head_weights(head) is not None
        and getattr(config, "model_type", None) in PLAIN_HEAD_FAMILIES
        and getattr(config, "final_logit_softcapping", None) is None
    )


@contextmanager
def lm_head_skipped(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model``'s own forward with its ``lm_head`` handing back its input, so the ``logits``
    are the decoder's last hidden states; yields ``lm_head``.

    Two hooks on ``lm_head`` while the context lasts: the first (ahead of any TP style's) keeps the
    hidden states and gives the head one position of zeros, so its forward costs next to nothing
    and moves nothing; the second returns the kept hidden states as the head's output. The root
    forward runs, not ``model.model``: FSDP's root unshards the embedding, the final norm and
    ``lm_head`` in it (and keeps them unsharded for backward), and an MoE family adds its router
    aux loss. The head runs in eval mode meanwhile, so the zero position draws no random numbers
    (an adapter's dropout): the chunked loss draws them once, where the head's forward would.
    """
    head, kept = model.lm_head, []
    modes = [(module, module.training) for module in head.modules()]

    def keep(module: nn.Module, args: tuple) -> tuple:
        kept.append(args[0])
        return (_one_zero_token(args[0]), *args[1:])

    handles = [
        head.register_forward_pre_hook(keep, prepend=True),
        head.register_forward_hook(lambda module, args, output: _whole(kept.pop())),
    ]
    head.train(False)
    try:
        yield head
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training


def _whole(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden``, or the tensor it views when it is all of it (the family's forward hands the head
    ``hidden_states[:, 0:, :]``): the root's output is then no view, which FSDP2 warns about on
    every rank (an in-place op on a view would skip its pre-backward hook; none is done)."""
    base = hidden._base
    if base is None or (base.dtype, base.shape) != (hidden.dtype, hidden.shape):
        return hidden
    same = (base.stride(), base.storage_offset()) == (hidden.stride(), hidden.storage_offset())
    return base if same else hidden


def _one_zero_token(hidden: torch.Tensor) -> torch.Tensor:
    """Zeros of one position shaped like ``hidden`` [batch, seq, hidden], outside the autograd
    graph; for a DTensor a replicated one, which a TP style's input redistribution leaves as is (no
    collective). DTensor ops refuse a zero-length sequence, so one position it is."""
    local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    zeros = local.new_zeros(local.shape[0], 1, local.shape[-1])
    if not isinstance(hidden, DTensor):
        return zeros
    placements = [Replicate()] * hidden.device_mesh.ndim
    return DTensor.from_local(zeros, hidden.device_mesh, placements, run_check=False)
