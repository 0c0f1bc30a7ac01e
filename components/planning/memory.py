"""Memory measured: the peak of a training step (the metrics line's ``peak_memory_gib``) and the
memory held now (the dry run's measurement, which the memory model is checked against).

On CUDA: ``torch.cuda.max_memory_allocated`` (tensors only, not the allocator's cache), reset per
step. On the CPU: the process's peak resident set size, ``VmHWM`` in ``/proc/self/status``, which
Linux lets a process reset by writing ``5`` to ``/proc/self/clear_refs`` (since 4.0), so it is a
true per-step peak, not a sampled one. It counts everything the process holds (the Python runtime,
torch's libraries, allocator slack), not only tensors. Where that file cannot be written (not Linux,
a locked-down /proc) the figure is ``ru_maxrss``: the peak since the process started, which cannot
be reset; :func:`reset_peak_memory` then returns False so a caller can say so.
"""

import resource
import sys
from pathlib import Path

import torch

GIB = 1024**3
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory(device: torch.device | str) -> bool:
    """Start a new peak: the next :func:`peak_memory_gib` covers only what happens from now on.

    Returns False when the peak cannot be reset (the CPU without a writable
    ``/proc/self/clear_refs``); the figure then is the process's peak since start.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory in GiB since the last :func:`reset_peak_memory` (see the module docstring for
    what counts)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return _peak_rss_bytes() / GIB


def current_memory_gib(device: torch.device | str) -> float:
    """Memory in GiB held now: CUDA allocated bytes, or the process's resident set size on the
    CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GIB
    return _status_kib("VmRSS") * 1024 / GIB if _STATUS.is_file() else _peak_rss_bytes() / GIB


def _peak_rss_bytes() -> int:
    if _STATUS.is_file():
        return _status_kib("VmHWM") * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise ValueError(f"{field} not in {_STATUS}")
