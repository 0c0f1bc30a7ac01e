"""Process start-up: join a world started by torchrun, or start local ranks with PyTorch's launcher API."""

import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

# Every collective gives up after this long instead of hanging forever when a peer has died.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def started_by_launcher() -> bool:
    """True when torchrun (or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK) started this process."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch_local(entrypoint: Callable[..., Any], nproc: int, *args: Any, start_method: str = "fork") -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks and return each rank's result.

    ``fork`` starts a rank in well under a second once torch is imported (a fresh interpreter costs ~5 s);
    use ``spawn`` when CUDA is already initialised in this process. A rank failure fails the whole launch.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    return elastic_launch(config, entrypoint)(*args)


def init_process_group(backend: str) -> None:
    """Join the world described by the launcher's environment, with a collective timeout."""
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
