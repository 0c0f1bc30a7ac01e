"""glibc's malloc settings for the recipe's processes, so that a CPU rank's resident memory reads
as its live bytes (docs/design-notes.md, the memory model; docs/benchmarks-history.md section 20).

With glibc's defaults a CPU rank's peak RSS sits 0.4-0.8 GiB above its live bytes: the runtime's
small objects (autograd nodes, tensor headers, Python's larger objects) are carved out of freed
tensor blocks, and once freed they wait in the per-thread cache (tcache) and the fast bins, which
never coalesce, so the blocks around them cannot merge and be reused by the next tensor. With both
off (``tcache_count=0``, ``mxfast=0``) a freed small chunk coalesces at once. Setting a malloc
tunable turns glibc's dynamic mmap threshold off, so the threshold is set to that rule's ceiling
(32 MiB, where it settles in a training step anyway) and the trim threshold to 1 GiB, so the top of
the heap stays resident from step to step instead of being returned and faulted in again.

glibc reads ``GLIBC_TUNABLES`` once, when a process starts, so the recipe's command executes itself
again, once, with them added (before torch is imported; forked ranks inherit the settings). A
``GLIBC_TUNABLES`` that already sets any ``glibc.malloc`` tunable, or a ``MALLOC_*`` variable, is
the user's choice and is left as it is (``GLIBC_TUNABLES=glibc.malloc.tcache_count=7``: glibc's
defaults). Other C libraries (musl, macOS) are left alone.
"""

import os
import platform
import sys

TUNABLES = (
    "glibc.malloc.tcache_count=0",
    "glibc.malloc.mxfast=0",
    "glibc.malloc.mmap_threshold=33554432",
    "glibc.malloc.trim_threshold=1073741824",
)


def malloc_environment(environment: dict[str, str]) -> dict[str, str] | None:
    """``environment`` with the recipe's malloc tunables added, or None where it needs none: not
    glibc, or the user already chose malloc settings (see the module docstring)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    given = environment.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in given or any(key.startswith("MALLOC_") for key in environment):
        return None
    return {**environment, "GLIBC_TUNABLES": ":".join(filter(None, (given, *TUNABLES)))}


def exec_with_malloc_settings() -> None:
    """Execute this command again with :data:`TUNABLES`, unless it needs none; call it first."""
    environment = malloc_environment(dict(os.environ))
    if environment is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
