"""The flat buffers of a TP replica gradient sync: its buckets, their memory, packing and unpacking.

:class:`BucketLayout` cuts gradients into buckets by (reduction, device, dtype) and the byte bound
and owns their buffers, bounded together by ``max_bytes``: FP32 (wire-dtype) buckets of plain
gradients whose slots become the gradients (DDP's ``gradient_as_bucket_view``: bound before a
backward by :meth:`BucketLayout.bind`, or handed out by a reduction), so the next reduction runs in
place, and one shared staging buffer, reused bucket after bucket, for the rest (bf16/fp16 upcast to
FP32, DTensor gradients). "In place" is decided by data pointer, so a gradient given other storage
(``grad.data = ...``, ``model.to(...)``) is packed again; gradients that are not yet the bucket's
slices get the result copied into them and are then re-bound, except slices of another tensor (a
caller's own flat buffer), which stay bound there. The layout knows nothing of modules or process
groups: ``replicas/plan.py`` decides when to build one, and ``tp_replicas`` reduces each buffer it
hands out (:meth:`BucketLayout.exchange`), so every collective goes through that module's ``dist``.
"""

from collections import deque
from collections.abc import Iterator
from itertools import repeat
from operator import attrgetter, eq, is_, itemgetter

import torch
from torch import nn

from components.distributed.replicas.flat_buffers import (
    bounded_chunks,
    flat_aliases,
    flat_views,
    wire_dtype,
)

_grad = attrgetter("grad")
_version = attrgetter("_version")
_consume = deque(maxlen=0).extend  # runs an iterator for its side effects

_data_ptr = torch.Tensor.data_ptr
_is_view = torch.Tensor._is_view


def _pointers(tensors) -> list[int] | None:
    """Each tensor's data pointer, in one C-level pass; None when one of them is missing."""
    try:
        return list(map(_data_ptr, tensors))
    except (TypeError, RuntimeError):  # a None, or a tensor without storage of its own
        return None


class _Bucket:
    """One collective: gradients (by candidate index) of one (reduction, device, dtype), at most the
    bound."""

    def __init__(self, reduction: str, indices: list[int], gradients: list[torch.Tensor]):
        self.reduction, self.indices = reduction, indices
        # picks this bucket's gradients out of the list of every candidate's, in one C call
        self.pick = (
            itemgetter(*indices) if len(indices) > 1 else lambda grads, i=indices[0]: (grads[i],)
        )
        self.device = gradients[0].device
        self.dtype = gradients[0].dtype
        self.wire = wire_dtype(self.dtype)
        self.numel = sum(g.numel() for g in gradients)
        self.nbytes = self.numel * self.wire.itemsize
        self.shapes = [g.shape for g in gradients]
        # 1-D gradients pack with one torch.cat (one kernel) instead of a copy per tensor
        self.one_dimensional = all(len(shape) == 1 for shape in self.shapes)
        self.as_view = False
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # the buffer's slices, never handed out
        # as_view only: the slices handed out as gradients (other objects: ``grad.data = ...`` on
        # one cannot
        # move ``views``), the slices' data pointers, and the buffer's address range
        self.handed: list[torch.Tensor] = []
        self.view_pointers: list[int] | None = None
        self.span = (0, 0)

    def pack(
        self, flat: torch.Tensor, views: list[torch.Tensor], grads: tuple[torch.Tensor, ...]
    ) -> None:
        """Copy (and upcast) ``grads`` into ``flat``, whose slices are ``views``; no gradient may
        overlap ``flat``."""
        # cat upcasts bf16/fp16 through an FP32 temporary per gradient (RSS above the bound); copy_
        # casts in place
        if self.one_dimensional and self.wire == self.dtype:
            torch.cat(grads, out=flat)
        else:
            torch._foreach_copy_(views, list(grads))

    def hand_out(self, parameters: tuple[nn.Parameter, ...], keep: list[bool] | None) -> None:
        """Make the buffer's slices the gradients of ``parameters`` (except where ``keep``)."""
        # a handed-out slice was given other storage since
        if _pointers(self.handed) != self.view_pointers:
            self.handed = flat_views(self.flat, self.shapes)
        if keep is None:
            _consume(map(setattr, parameters, repeat("grad"), self.handed))
            return
        for parameter, view, kept in zip(parameters, self.handed, keep, strict=True):
            if not kept:
                parameter.grad = view


class BucketLayout:
    """Buckets for one set of eligible candidates, with persistent buffers bounded by ``max_bytes``
    in all.

    ``persistent=False`` allocates each bucket's buffer only while it is reduced (one at a time).
    """

    def __init__(
        self,
        gradients: list[torch.Tensor],
        reductions: list[str],
        indices: list[int],
        plain: list[bool],
        device: torch.device | str,
        max_bytes: int,
        persistent: bool = True,
    ):
        groups: dict[tuple, list[int]] = {}
        for index in indices:
            grad = gradients[index]
            groups.setdefault((reductions[index], grad.device, grad.dtype), []).append(index)
        self.buckets: list[_Bucket] = []
        for (reduction, _, _), members in groups.items():
            start = 0
            # consecutive runs
            for chunk in bounded_chunks([gradients[i] for i in members], max_bytes):
                self.buckets.append(_Bucket(reduction, members[start : start + len(chunk)], chunk))
                start += len(chunk)
        self.count = sum(len(bucket.indices) for bucket in self.buckets)  # gradients reduced
        self.device = torch.device(device)  # the collectives' kind of device ("cuda" has no index)
        self.size = len(gradients)
        # by candidate: the data pointer of its slice in a view bucket (None: staged); when every
        # bucket is
        # gradient views, also the slices themselves
        self.slot_pointers: list[int | None] = [None] * self.size
        self.views_in_order: list[torch.Tensor | None] | None = None
        self.spans: list[tuple[int, int]] = []  # address ranges of the view buckets' buffers
        # bind(): the slots as aliases (by candidate), the parameters they were bound to and each
        # alias's version then (None: nothing bound since the last release)
        self.bound: list[torch.Tensor] | None = None
        self._bound_to: list[nn.Parameter] = []
        self._bound_versions: list[int] | None = None
        if persistent:
            self._assign_buffers(plain, max_bytes)

    def _reduced_on(self, bucket: _Bucket) -> torch.device:
        """A bucket's buffer device: its gradients' own (index included) when the collectives run on
        that kind of device, else the collectives' (CPU gradients staged for NCCL)."""
        return bucket.device if bucket.device.type == self.device.type else self.device

    def _assign_buffers(self, plain: list[bool], budget: int):
        """Make plain FP32-on-the-wire buckets gradient views while views + staging stay within
        ``budget``.

        A bucket above the budget (one oversized gradient) gets a buffer only while it is reduced.
        """
        fits = [b for b in self.buckets if b.nbytes <= budget]
        same_kind = [b for b in fits if b.wire == b.dtype and b.device.type == self.device.type]
        viewable = [b for b in same_kind if all(plain[i] for i in b.indices)]
        staging = max((b.nbytes for b in fits if b not in viewable), default=0)
        viewable.sort(key=lambda b: -b.nbytes)
        views = 0
        for position, bucket in enumerate(viewable):
            # if every smaller bucket ends up staged, staging grows to the next one's size at most
            following = viewable[position + 1].nbytes if position + 1 < len(viewable) else 0
            if views + bucket.nbytes + max(staging, following) <= budget:
                bucket.as_view = True
                views += bucket.nbytes
            else:
                staging = max(staging, bucket.nbytes)
        # one staging buffer per device (one in practice)
        shared: dict[torch.device, torch.Tensor] = {}
        for bucket in fits:
            device = self._reduced_on(bucket)
            if bucket.as_view:
                bucket.flat = torch.zeros(bucket.numel, dtype=bucket.wire, device=device)
                bucket.handed = flat_views(bucket.flat, bucket.shapes)
                bucket.span = (bucket.flat.data_ptr(), bucket.flat.data_ptr() + bucket.nbytes)
                self.spans.append(bucket.span)
            else:
                if device not in shared:
                    shared[device] = torch.empty(staging, dtype=torch.uint8, device=device)
                bucket.flat = shared[device][: bucket.nbytes].view(bucket.wire)
            bucket.views = flat_views(bucket.flat, bucket.shapes)
            if bucket.as_view:
                bucket.view_pointers = _pointers(bucket.views)
                for index, pointer in zip(bucket.indices, bucket.view_pointers, strict=True):
                    self.slot_pointers[index] = pointer
        if self.buckets and all(bucket.as_view for bucket in self.buckets):
            self.views_in_order = [None] * self.size
            for bucket in self.buckets:
                for index, view in zip(bucket.indices, bucket.views, strict=True):
                    self.views_in_order[index] = view

    def gradients_are_views(self, parameters: list[nn.Parameter]) -> bool:
        """True when the gradients of ``parameters`` (every candidate, in order) occupy exactly this
        layout's bucket
        slices: all present, dense and reduced in place. By data pointer, not identity: ``grad.data
            = ...``, ``grad.set_(...)`` or ``model.to(...)`` give a gradient object other storage
            (one pass, no list kept)."""
        return (
            self.views_in_order is not None
            and _pointers(map(_grad, parameters)) == self.slot_pointers
        )

    def bind(self, parameters: list[nn.Parameter]) -> int:
        """Zero every bucket and make its slots the gradients of ``parameters`` (every candidate, in
        order), so a backward accumulates into the buckets; the number bound (0 unless every bucket
        is gradient views; 0, every gradient ``None``, when a parameter no longer fits its slot).
        The slots are aliases, not views (:func:`flat_aliases`): each one's version tells
        :meth:`release_untouched` whether a gradient was accumulated into it."""
        if self.views_in_order is None:
            return 0
        if self.bound is None or _pointers(self.bound) != self.slot_pointers:
            self.bound = [None] * self.size  # made once; again if one was given other storage
            for bucket in self.buckets:
                aliases = flat_aliases(bucket.flat, bucket.shapes)
                for index, alias in zip(bucket.indices, aliases, strict=True):
                    self.bound[index] = alias
        for bucket in self.buckets:
            bucket.flat.zero_()
        try:  # the gradient setter checks each slot's dtype, device and shape against its parameter
            _consume(map(setattr, parameters, repeat("grad"), self.bound))
        except RuntimeError:  # a parameter cast or moved since: it no longer fits its slot
            _consume(map(setattr, parameters, repeat("grad"), repeat(None)))
            return 0
        self._bound_to, self._bound_versions = parameters, list(map(_version, self.bound))
        return self.size

    def release_untouched(self) -> bool:
        """After the backward that followed :meth:`bind`: a parameter whose gradient is still its
        bound slot, with nothing accumulated into it, gets ``None`` back (what ``zero_grad()`` left
        it), so a parameter the backward did not reach still has no gradient. True when every slot
        was bound and accumulated into since (so every parameter required grad in the backward)."""
        if self._bound_versions is None:
            return False
        parameters, versions = self._bound_to, self._bound_versions
        self._bound_to, self._bound_versions = [], None
        now = list(map(_version, self.bound))
        if not any(map(eq, now, versions)):  # every slot was accumulated into: the usual step
            return True
        bound = map(is_, map(_grad, parameters), self.bound)
        for parameter, same, before, after in zip(parameters, bound, versions, now, strict=True):
            if same and before == after:
                parameter.grad = None
        return False

    def exchange(
        self,
        parameters: list[nn.Parameter],
        local_grads: list[torch.Tensor],
        in_place: bool = False,
    ) -> Iterator[tuple[torch.Tensor, str]]:
        """Each bucket's packed flat wire buffer with its reduction (``"mean"`` or ``"sum"``).

        The caller reduces each buffer in place (SUM, then the mean's divide) before asking for
        the next; the result is then copied back into the gradients, in place, or already is them
        (bucket views). ``in_place``: the caller has checked :meth:`gradients_are_views`, so
        nothing is packed or unpacked. The layout issues no collective itself.
        """
        if in_place:
            for bucket in self.buckets:
                yield bucket.flat, bucket.reduction
            return
        # data pointers, read once (a None where a gradient is absent): only view buckets need them
        pointers = None
        if self.spans:
            pointers = _pointers(local_grads) or [
                0 if grad is None else _data_ptr(grad) for grad in local_grads
            ]
        sources, moved = self._read_apart(local_grads, pointers)
        for bucket in self.buckets:
            if bucket.as_view:
                picked = (bucket.pick(parameters), bucket.pick(local_grads), bucket.pick(sources))
                picked += (bucket.pick(moved), bucket.pick(pointers))
                yield from self._exchange_views(bucket, *picked)
                continue
            flat, views = bucket.flat, bucket.views
            if flat is None:
                flat = torch.empty(bucket.numel, dtype=bucket.wire, device=self._reduced_on(bucket))
                views = flat_views(flat, bucket.shapes)
            bucket.pack(flat, views, bucket.pick(sources))
            yield flat, bucket.reduction
            # copy_ casts in place (a mul with out= stages FP32 on CPU)
            torch._foreach_copy_(list(bucket.pick(local_grads)), views)

    def _read_apart(
        self, grads: list[torch.Tensor | None], pointers: list[int] | None
    ) -> tuple[list, list[bool]]:
        """The gradients to pack, with a copy of each one that is a slice of a view bucket other
        than its own (swapped, or moved by hand: packing or reducing the buckets would overwrite
        it), and which those are. ``pointers``: the gradients' data pointers (None: no view
        bucket)."""
        moved = [False] * len(grads)
        if pointers is None:
            return grads, moved
        low, high = min(lo for lo, _ in self.spans), max(hi for _, hi in self.spans)
        # the usual fresh gradients: one cheap pass
        if not any(low <= pointer < high for pointer in pointers):
            return grads, moved
        for index, (pointer, own) in enumerate(zip(pointers, self.slot_pointers, strict=True)):
            moved[index] = pointer != own and any(lo <= pointer < hi for lo, hi in self.spans)
        return [g.clone() if m else g for g, m in zip(grads, moved, strict=True)], moved

    def _exchange_views(
        self, bucket, parameters, grads, sources, moved, pointers
    ) -> Iterator[tuple[torch.Tensor, str]]:
        """A view bucket: in place when every gradient is its slice; else packed, reduced by the
        caller, the result copied back into the gradients handed in (in place), and the buffer's
        slices made the gradients from now on.

        Gradients already in their slice are not copied; gradients that are slices of another tensor
        (someone's own flat buffer) get the result and stay bound where they are.
        """
        own = list(map(eq, pointers, bucket.view_pointers))  # each gradient already its slice
        if all(own):
            yield bucket.flat, bucket.reduction
            return
        # copy only the others: a slice copied onto itself is fine, but cat refuses any overlap
        if any(own):
            pairs = [
                (view, source)
                for view, source, mine in zip(bucket.views, sources, own, strict=True)
                if not mine
            ]
            torch._foreach_copy_([view for view, _ in pairs], [source for _, source in pairs])
        else:
            bucket.pack(bucket.flat, bucket.views, sources)
        yield bucket.flat, bucket.reduction
        # outside every view bucket
        elsewhere = [not (mine or m) for mine, m in zip(own, moved, strict=True)]
        targets = [(g, v) for g, v, out in zip(grads, bucket.views, elsewhere, strict=True) if out]
        if targets:
            torch._foreach_copy_([g for g, _ in targets], [v for _, v in targets])
        keep = None
        if any(map(_is_view, (g for g, _ in targets))):
            keep = [out and _is_view(g) for g, out in zip(grads, elsewhere, strict=True)]
        bucket.hand_out(parameters, keep)
