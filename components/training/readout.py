"""A step's host readout: the values a training step must see on the host after its update (the
loss, the busiest rank's peak memory, the stop and save flags, the MoE load) reduced in one
collective on the device's own backend and read with one ``tolist``. With the grad norm, read once
before the update (the non-finite decision), these are a step's reads of the device, whatever the
gradient accumulation, layer count or expert count.
"""

import torch
import torch.distributed as dist

from components.planning.memory import peak_memory_gib


class StepReadout:
    """Made once per run: the loss group's ranks are looked up here, not per step (slicing a
    DeviceMesh reads its rank tensor on the host)."""

    def __init__(self, loss_group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ranks = dist.get_process_group_ranks(loss_group) if loss_group is not None else [self.rank]
        self.loss_ranks = torch.tensor(ranks, device=device)
        self.device = device
        self.writer = None  # the run's checkpoint writer, once there is one: its flags join in

    def read(
        self, loss_sum: torch.Tensor, stop_requested: bool, counts: torch.Tensor | None
    ) -> tuple[float, float, list]:
        """The step's values after its update, in one collective and one read: ``loss_sum``
        summed over the loss group (dp × cp: each rank holds a part of the global batch), the
        busiest rank's peak memory, the checkpoint writer's flags (``step_flags`` with
        ``stop_requested``, the largest over every rank, handed to its ``agree``), and the MoE
        load ``counts`` (already the same where they are read) as ``tolist`` gives them. Returns
        the loss sum, the peak memory in GiB and the counts (or [])."""
        writer = self.writer
        flags = writer.step_flags(stop_requested) if writer is not None else []
        maxima = [peak_memory_gib(self.device), *flags]
        loss, (peak, *agreed), rows = self.gather(loss_sum, maxima, counts)
        if writer is not None:
            writer.agree(agreed)  # publishes a save every rank has written; keeps the stop
        return loss, peak, rows

    def gather(
        self, loss_sum: torch.Tensor, maxima: list[float], kept: torch.Tensor | None = None
    ) -> tuple[float, list[float], list]:
        """``loss_sum`` summed over the loss group's ranks, each of ``maxima`` (host numbers) the
        largest over every rank, and ``kept`` as it is (in its shape, as ``tolist`` gives it).

        One all-reduce of a (world × values) table, each rank's row its own and zeros elsewhere: a
        sum that is a gather, exactly, so sums and maxima come out of one collective. Then one
        read of the device."""
        width = 1 + len(maxima)
        table = torch.zeros((self.world, width), dtype=torch.float64, device=self.device)
        table[self.rank, 0] = loss_sum  # on the device: no host read
        for column, value in enumerate(maxima, start=1):
            table[self.rank, column] = value  # a fill with a host number: no copy, no wait
        if self.world > 1:
            dist.all_reduce(table)  # the default group: NCCL for CUDA tensors, gloo for the CPU's
        loss = table[:, 0].index_select(0, self.loss_ranks).sum()
        parts = [loss.reshape(1), table[:, 1:].amax(dim=0)]
        if kept is not None:
            parts.append(kept.reshape(-1).to(torch.float64))
        values = torch.cat(parts).tolist()  # the read
        rest = values[width:]
        if kept is not None and kept.dim() == 2:
            columns = kept.shape[1]
            rest = [rest[start : start + columns] for start in range(0, len(rest), columns)]
        return values[0], values[1:width], rest
