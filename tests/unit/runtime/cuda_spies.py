"""Run the recipe's launcher up to its fork with CUDA reported present (2 GPUs by NVML) and every
way of starting CUDA spied; print what was seen as JSON. In a fresh interpreter (``python -m``) so
that the launcher's imports count too (all but torch's compiler, imported first: with CUDA faked
present it would import kernels this CPU build lacks). Used by ``test_launch_before_fork.py``."""

import json
import multiprocessing.process
import os
import sys

import torch
import torch._dynamo  # noqa: F401 - before the spies (see above)

import components.runtime.launch as launch
import components.runtime.world as world

CALLS: list[str] = []


def _spy(name: str, result):
    def spy(*args, **kwargs):
        CALLS.append(name)
        return result

    return spy


def install_spies(gpus: int) -> None:
    """CUDA built and present to NVML; any call that starts CUDA (or asks the runtime) is noted.
    ``torch.cuda.is_available`` is torch's own: libraries call it at import (torchao), and it
    must answer from NVML here, not from the runtime."""
    torch._C._cuda_getDeviceCount = _spy("torch._C._cuda_getDeviceCount", gpus)
    torch._C._cuda_init = _spy("torch._C._cuda_init", None)
    torch.cuda._lazy_init = _spy("torch.cuda._lazy_init", None)
    torch.cuda.init = _spy("torch.cuda.init", None)
    torch.cuda._device_count_nvml = lambda: gpus
    world._nvidia_driver_present = lambda: True


def main(overrides: list[str]) -> None:
    install_spies(gpus=2)
    seen, elastic_launch = {}, launch.elastic_launch

    def launching(config, entrypoint):  # torch elastic's launch: its agent then forks the ranks
        run = elastic_launch(config, entrypoint)

        def start(folder, launcher_pid, rank_main, *args):  # args: the rank's, the plan last
            seen.update(nproc=config.nproc_per_node, device_type=args[-1].device_type)
            return run(folder, launcher_pid, rank_main, *args)

        return start

    def fork(process):  # the first rank's fork: report, and end here
        seen.update(cuda_initialized=torch.cuda.is_initialized())
        print(json.dumps(seen | {"calls": CALLS}), flush=True)
        os._exit(0)

    launch.elastic_launch = launching
    multiprocessing.process.BaseProcess.start = fork
    from recipes.compose import compose
    from recipes.finetune import run

    run(compose(overrides), None, None)
    raise SystemExit("no rank was started")


if __name__ == "__main__":
    main(sys.argv[1:])
