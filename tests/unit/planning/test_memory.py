"""Peak memory per step on the CPU: the process's peak RSS, reset per step through
/proc/self/clear_refs."""

import torch

from components.planning.memory import current_memory_gib, peak_memory_gib, reset_peak_memory

MIB = 1024**2


def test_the_cpu_peak_sees_a_freed_allocation_and_resets():
    assert reset_peak_memory("cpu")  # Linux: the peak can be reset
    before = peak_memory_gib("cpu")
    block = torch.ones(256 * MIB // 4)  # 256 MiB, touched, then freed
    del block
    peak = peak_memory_gib("cpu")
    assert peak - before > 0.2  # the freed 256 MiB is in the peak
    assert reset_peak_memory("cpu")
    after_reset = peak_memory_gib("cpu")
    assert after_reset < peak - 0.2  # a new step starts from what is held now
    assert abs(after_reset - current_memory_gib("cpu")) < 0.05
