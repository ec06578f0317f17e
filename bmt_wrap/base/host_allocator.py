"""The host allocator setting under which a CPU process holds what its tensors hold (docs/design.md
"Capacity"): the plan's memory count and ``memory_budget=`` are exact under it, and only under it."""

from __future__ import annotations

import os
import platform

# glibc maps every allocation of 64 KiB or more and unmaps it when freed; left unset, its threshold rises
# with each mapped block freed (up to 32 MiB) and the heap below it keeps what tensors free. 1 MiB was
# enough for a GPT of width 1024, but a model of width 384 has most tensors under 1 MiB (a 384 x 384
# weight's gradient, a 4 x 128 x 384 activation), so its heap grew by about 100 MiB a step (RESULTS.md,
# "The plan on models it was not tuned on"); 64 KiB cost the GPT about 4% more step time than 1 MiB.
# Only that value is exact: a higher one leaves the heap the tensors under it (the 1 MiB above), and a lower
# one maps allocations under 64 KiB one by one, each rounded up to a 4 KiB page (up to twice a small
# tensor's bytes) and each a mapping of the kernel's limited count; neither was measured to match the count.
THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"
EXACT_THRESHOLD = 65536
EXACT_SETTING = f"{THRESHOLD_VAR}={EXACT_THRESHOLD}"


def threshold() -> int | None:
    """This process's ``MALLOC_MMAP_THRESHOLD_`` as glibc reads it (decimal or 0x hex); None when unset or not
    a number."""
    try:
        return int(os.environ[THRESHOLD_VAR], 0)
    except (KeyError, ValueError):
        return None


def counts_exactly() -> bool:
    """Whether freed tensors leave this process as the count assumes: true off glibc, and on glibc only at
    ``EXACT_SETTING``."""
    return platform.libc_ver()[0] != "glibc" or threshold() == EXACT_THRESHOLD


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing): what a
    process measures of itself afterwards is what it holds, whatever its allocator setting."""
    if platform.libc_ver()[0] != "glibc":
        return
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
