"""The host allocator setting under which a CPU process holds what its tensors hold (docs/design.md
"Capacity"): the plan's memory count and ``memory_budget=`` are exact under it, and only under it."""

from __future__ import annotations

import os
import platform

# glibc maps every allocation of 1 MiB or more and unmaps it when freed; left unset, its threshold rises
# with each mapped block freed (up to 32 MiB) and the heap below it keeps what tensors free.
THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"
EXACT_SETTING = f"{THRESHOLD_VAR}=1048576"


def counts_exactly() -> bool:
    """Whether freed tensors leave this process: true off glibc, and on glibc with the threshold fixed."""
    return platform.libc_ver()[0] != "glibc" or THRESHOLD_VAR in os.environ
