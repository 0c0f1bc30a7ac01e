"""A step's host readout: every value a training step must see on the host (the grad norm and so
the non-finite decision, the loss, the busiest rank's peak memory, the stop and save flags, the
MoE load, the gradient finalisation's checks) reduced in one collective on the device's own backend
and read with one ``tolist``, before the update. With the replica sync's presence check (the
spec's, before any gradient moves) these are a step's reads of the device, whatever the gradient
accumulation, layer or expert count; the first step adds the finalisation's own check, once.

A step's peak memory runs from the previous step's update through this step's gradients: the
update's own peak is taken after it (a host call, no device wait) and joins the next step's.
"""

import torch
import torch.distributed as dist

from components.distributed.step_finalizer import StepFinalizer
from components.planning.memory import peak_memory_gib


class StepReadout:
    """Made once per run: the loss group's ranks are looked up here, not per step (slicing a
    DeviceMesh reads its rank tensor on the host)."""

    def __init__(
        self, loss_group: dist.ProcessGroup | None, device: torch.device, finalizer: StepFinalizer
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ranks = dist.get_process_group_ranks(loss_group) if loss_group is not None else [self.rank]
        self.loss_ranks = torch.tensor(ranks, device=device)
        self.device = device
        self.writer = None  # the run's checkpoint writer, once there is one: its flags join in
        self.finalizer = finalizer  # the step's gradient finalisation: its checks join in
        self._update_peak = 0.0  # the previous step's update's peak (GiB), joins the next read

    def read(
        self,
        norm: torch.Tensor,
        loss_sum: torch.Tensor,
        stop_requested: bool,
        counts: torch.Tensor | None,
    ) -> tuple[float, float | list[float], float, list]:
        """The step's values before its update, in one collective and one read: the grad
        ``norm`` (already the same on every rank), ``loss_sum`` summed over the loss group (dp ×
        cp: each rank holds a part of the global batch; a 1-D tensor of several sums, DPO's
        metrics, sums each and comes back a list), the busiest rank's peak memory, the
        checkpoint writer's flags (``step_flags`` with ``stop_requested``, the largest over every
        rank, handed to its ``agree``), the finalisation's problems (raised on every rank) and
        the MoE load ``counts`` (already the same where they are read) as ``tolist`` gives them.
        Returns the norm, the loss sum, the peak memory in GiB and the counts (or [])."""
        writer = self.writer
        flags = writer.step_flags(stop_requested) if writer is not None else []
        problems = self.finalizer.problems()  # on the device: no read
        maxima = [max(peak_memory_gib(self.device), self._update_peak), problems, *flags]
        kept = [norm.reshape(1)] + ([] if counts is None else [counts.flatten()])
        kept = torch.cat([part.to(torch.float64) for part in kept])
        loss, (peak, problems, *agreed), (norm_value, *rest) = self.gather(loss_sum, maxima, kept)
        if writer is not None:
            writer.agree(agreed)  # publishes a save every rank has written; keeps the stop
        self.finalizer.verify(problems)  # raises on every rank, before the update
        if counts is not None and counts.dim() == 2:
            columns = counts.shape[1]
            rest = [rest[start : start + columns] for start in range(0, len(rest), columns)]
        return norm_value, loss, peak, rest

    def after_update(self) -> None:
        """Note the update's peak (this step's since its start: a host call) for the next read."""
        self._update_peak = peak_memory_gib(self.device)

    def gather(
        self, loss_sum: torch.Tensor, maxima: list, kept: torch.Tensor | None = None
    ) -> tuple[float | list[float], list[float], list]:
        """``loss_sum`` summed over the loss group's ranks (a 0-dim tensor: a number; 1-D: a
        list of sums), each of ``maxima`` (host numbers or device scalars) the largest over every
        rank, and ``kept`` as it is (flattened, as ``tolist`` gives it).

        One all-reduce of a (world × values) table, each rank's row its own and zeros elsewhere: a
        sum that is a gather, exactly, so sums and maxima come out of one collective. Then one
        read of the device."""
        sums = loss_sum.numel()
        width = sums + len(maxima)
        table = torch.zeros((self.world, width), dtype=torch.float64, device=self.device)
        table[self.rank, :sums] = loss_sum.reshape(sums)  # on the device: no host read
        for column, value in enumerate(maxima, start=sums):
            table[self.rank, column] = value  # a fill or a device copy: no wait
        if self.world > 1:
            dist.all_reduce(table)  # the default group: NCCL for CUDA tensors, gloo for the CPU's
        loss = table[:, :sums].index_select(0, self.loss_ranks).sum(dim=0)
        parts = [loss, table[:, sums:].amax(dim=0)]
        if kept is not None:
            parts.append(kept.reshape(-1).to(torch.float64))
        values = torch.cat(parts).tolist()  # the read
        summed = values[0] if loss_sum.dim() == 0 else values[:sums]
        return summed, values[sums:width], values[width:]
