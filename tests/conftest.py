"""One intra-op thread for the torch work a test does in the pytest process itself.

``make test`` runs three pytest workers on 2 cores, beside the ranks and recipe runs they start:
torch's default of a thread per core in each worker oversubscribes the cores, and its OpenMP
threads spin while they wait (tests/unit/models/test_lora.py: 38 CPU-seconds with the default, 13
with one thread, under load). The ranks of tests/harness.py set one thread each already; a recipe
run, a process of its own, keeps its own default (``cpu_threads``)."""

import sys


def pytest_collection_finish(session) -> None:
    """After the test modules are imported (torch among them, if a test uses it): never imports
    torch for a session that does not."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
