"""glibc's malloc settings for the recipe's processes, so that a CPU rank's resident memory reads
as its live bytes (why: docs/design-notes.md; measured: docs/benchmarks-history.md section 20).

glibc's per-thread cache and fast bins off (freed small chunks coalesce at once instead of pinning
freed tensor blocks), and, since setting a malloc tunable turns the dynamic mmap threshold off, the
threshold at that rule's ceiling (32 MiB) and the trim threshold at 1 GiB. glibc reads
``GLIBC_TUNABLES`` only when a process starts, and the local launcher forks its CPU ranks (a fork
keeps the launcher's imports; an exec would pay them again in every rank), so the ranks' malloc is
the launcher's: a command that will start ranks executes itself again, once, with the tunables
added, before its imports (``recipes/finetune.py``'s ``main``; ``--help`` and ``--cfg`` never do).
Under torchrun each rank is such a command. A ``GLIBC_TUNABLES`` that
sets any ``glibc.malloc`` tunable, or a ``MALLOC_*`` variable, is the user's choice and is kept
(``GLIBC_TUNABLES=glibc.malloc.tcache_count=7``: glibc's defaults); other C libraries: left alone.
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
    """Execute this command again with :data:`TUNABLES`, unless it needs none (or has them)."""
    environment = malloc_environment(dict(os.environ))
    if environment is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
