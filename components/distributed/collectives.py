"""The single-tensor all-gather and reduce-scatter under the installed torch's names: torch 2.13
calls them ``all_gather_single`` and ``reduce_scatter_single`` (the old names deprecated), torch
2.11 has only ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. Looked up at each call, so
a spy set on ``torch.distributed`` sees it."""

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` laid end to end on dim 0 into ``output``, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """The sum over ranks of ``tensor``'s rank-th block on dim 0, into ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, group=group)
