"""What a recipe's process reads or sets as it starts, before it imports torch: whether a launcher
(torchrun) started it and how such a rank ends, and CUDA kept unstarted until the ranks fork."""

import os
import sys
from typing import NoReturn


def started_by_launcher() -> bool:
    """True when torchrun (or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK) started this
    process."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def end_launched_rank() -> NoReturn:
    """End a rank torchrun started, after its work, the way a forked local rank ends
    (multiprocessing calls ``os._exit`` once the rank's function returns): flush the standard
    streams and skip the interpreter's finalisation. There, under torchrun, a process group's C++
    threads could be destroyed while still joinable: "terminate called without an active exception"
    and SIGABRT after a finished run. Call it only when every file is closed and every
    lock released."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def keep_cuda_unstarted() -> None:
    """Let libraries the launcher imports ask ``torch.cuda.is_available()`` without starting CUDA
    (torchao asks at import, through transformers' quantizers): by default torch answers through
    the CUDA runtime, which starts CUDA, and no rank forked afterwards could start it again. With
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` it answers from NVML (torch's own advice for processes
    that fork); a value the user set is kept."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
