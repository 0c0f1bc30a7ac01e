"""On a CUDA machine the local launcher checks and plans the run and forks its ranks without ever
starting CUDA itself (a forked rank could not start it again): GPUs are counted by NVML."""

import json
import subprocess
import sys

from tests.cli import REPO


def test_the_launcher_never_starts_cuda_before_it_forks(tmp_path):
    overrides = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    command = [sys.executable, "-m", "tests.unit.runtime.cuda_spies", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"nproc": 2, "device_type": "cuda", "cuda_initialized": False, "calls": []}
