"""A field of ``/proc/self/status`` in bytes: what memory tests read from the kernel (VmRSS, VmHWM)."""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str) -> int:
    """``field`` (a kB line of /proc/self/status, e.g. ``"VmHWM"``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/self/status")
