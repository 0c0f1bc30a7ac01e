"""TP replica gradient sync overlapped with the last micro-batch's backward (opt-in: the recipe
runs the boundary sync, bench/replica_sync.py measures this one against it).

Post-accumulate-grad hooks count, during the last micro-batch's backward, the gradients each bucket
still waits for; a full bucket is packed into its own FP32 buffer and all-reduced asynchronously,
strictly in bucket order, so every rank issues the same collectives in the same order.
:meth:`ReplicaSyncOverlap.finish` issues the rest, runs the int32 pre-check, waits, raises on every
rank together if it disagrees (gradients untouched), else divides (mean) and copies back: the
reductions of :func:`~components.distributed.tp_replicas.synchronize_tp_replica_gradients`, bitwise
equal. Use one or the other for a model, never both. Limits, checked at install: plain-tensor
replicas only (DTensor ones need ``finalize_dtensor_gradients`` and the boundary sync), at most
``MAX_FLAT_BUFFER_BYTES`` of buffers; install it once the parameters are final.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from components.distributed.replicas.flat_buffers import (
    MAX_FLAT_BUFFER_BYTES,
    bounded_chunks,
    flat_views,
    wire_dtype,
)
from components.distributed.replicas.selection import get_tp_mesh
from components.distributed.tp_replicas import tp_replicated_parameters

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


class _Bucket:
    def __init__(
        self, reduction: str, members: list[int], parameters: list[nn.Parameter], device: str
    ):
        self.reduction, self.members = reduction, members
        self.flat = torch.zeros(
            sum(parameters[i].numel() for i in members),
            dtype=wire_dtype(parameters[0].dtype),
            device=device,
        )
        self.views = flat_views(self.flat, [parameters[i].shape for i in members])
        self.waiting = len(members)
        self.work = None


class ReplicaSyncOverlap:
    """Hooks that all-reduce TP-replica gradient buckets during the last backward (see the module
    docstring). Usage::

        overlap = ReplicaSyncOverlap([model], device_mesh)  # after the TP plan and the broadcast
        for step ...:
            for i, batch in enumerate(micro_batches):
                if i == len(micro_batches) - 1:
                    overlap.last_micro_batch()  # before that micro-batch's backward
                forward_backward(...)
            overlap.finish()  # instead of synchronize_tp_replica_gradients
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        device_mesh: DeviceMesh | None,
        tp_axis_name: str = "tp",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        tp_mesh = get_tp_mesh(device_mesh, tp_axis_name)
        candidates = [
            entry
            for entry in tp_replicated_parameters(model_parts, device_mesh, tp_axis_name)
            if entry[1].requires_grad
        ]
        self.names = [name for name, _, _ in candidates]
        self.parameters = [parameter for _, parameter, _ in candidates]
        if any(
            isinstance(parameter, DTensor) for parameter in self.parameters
        ):  # e.g. sequence-parallel norms
            raise ValueError(
                "ReplicaSyncOverlap handles plain-tensor replicas only; use "
                "synchronize_tp_replica_gradients"
            )
        total = sum(p.numel() * wire_dtype(p.dtype).itemsize for p in self.parameters)
        if total > MAX_FLAT_BUFFER_BYTES:
            raise ValueError(
                f"ReplicaSyncOverlap needs {total} bytes of buffers, above {MAX_FLAT_BUFFER_BYTES}"
            )
        self.group = tp_mesh.get_group() if tp_mesh is not None else None
        self.size = tp_mesh.size() if tp_mesh is not None else 1
        self.buckets = self._buckets(
            [reduction for _, _, reduction in candidates], bucket_bytes, tp_mesh
        )
        self._bucket_of = {i: b for b in self.buckets for i in b.members}
        self._next = 0
        self.armed = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, p in enumerate(self.parameters)
            if self.group
        ]

    def _buckets(
        self, reductions: list[str], bucket_bytes: int, tp_mesh: DeviceMesh | None
    ) -> list[_Bucket]:
        groups: dict[tuple, list[int]] = {}
        for index, parameter in enumerate(self.parameters):
            groups.setdefault((reductions[index], parameter.device, parameter.dtype), []).append(
                index
            )
        buckets = []
        for (reduction, _, _), members in groups.items():
            start = 0
            for chunk in bounded_chunks([self.parameters[i] for i in members], bucket_bytes):
                device = tp_mesh.device_type if tp_mesh is not None else "cpu"
                buckets.append(
                    _Bucket(reduction, members[start : start + len(chunk)], self.parameters, device)
                )
                start += len(chunk)
        return buckets

    def _hook(self, index: int):
        def on_final_gradient(parameter: torch.Tensor) -> None:
            if self.armed:
                self._bucket_of[index].waiting -= 1
                self._launch_ready()

        return on_final_gradient

    def _launch(self, bucket: _Bucket) -> None:
        for view, index in zip(bucket.views, bucket.members, strict=True):
            grad = self.parameters[index].grad
            if grad is None or grad.layout != torch.strided:
                view.zero_()  # the pre-check at finish() raises on every rank
            else:
                view.copy_(grad)
        bucket.work = dist.all_reduce(
            bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def last_micro_batch(self) -> None:
        """Call before the backward of the last micro-batch of an optimizer step: arms the hooks."""
        for bucket in self.buckets:
            bucket.waiting, bucket.work = len(bucket.members), None
        self._next, self.armed = 0, True

    @torch.no_grad()
    def finish(self) -> int:
        """At the step boundary: issue the rest, pre-check, wait, raise or unpack; return gradients
        reduced."""
        if self.group is None or not self.parameters:
            return 0
        if not self.armed:  # no last_micro_batch() this step: everything is issued here
            self.last_micro_batch()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        self.armed = False
        grads = [p.grad for p in self.parameters]
        present = [g is not None for g in grads]
        sparse = [g is not None and g.layout != torch.strided for g in grads]
        flags = torch.tensor([present, present, sparse], dtype=torch.int32).to(
            self.buckets[0].flat.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        for bucket in self.buckets:
            bucket.work.wait()
        self._check(flags.cpu().tolist())
        count = 0
        for bucket in self.buckets:
            if bucket.reduction == "mean":
                bucket.flat.div_(self.size)
            targets = [
                (grads[i], v)
                for i, v in zip(bucket.members, bucket.views, strict=True)
                if grads[i] is not None
            ]
            if targets:
                torch._foreach_copy_([g for g, _ in targets], [v for _, v in targets])
            count += len(targets)
        return count

    def _check(self, flags: list[list[int]]) -> None:
        present, _, sparse = flags

        def names(bad: list[bool]) -> str:
            return ", ".join(name for name, is_bad in zip(self.names, bad, strict=True) if is_bad)

        if any(0 < c < self.size for c in present):
            raise RuntimeError(
                "Gradient presence differs across TP replicas: "
                f"{names([0 < c < self.size for c in present])}"
            )
        if any(sparse):
            raise RuntimeError(
                "Sparse gradients cannot be flattened for TP replica synchronization: "
                f"{names([c > 0 for c in sparse])}"
            )

    def remove(self) -> None:
        """Remove the hooks (the boundary sync can take over again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
