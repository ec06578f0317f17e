"""Reading the kernel sources: headers inlined, launch constants parsed (standard library only, so
tools/check_cuda.py can load this file without torch)."""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)  # inlining already includes once


def kernel_source(name: str) -> str:
    """The text of ``name`` with its local ``#include "..."`` headers inlined (each header once).

    Inlining makes the source self-contained, so NVRTC needs no include path and CuPy's compile
    cache (keyed by source text) sees header changes.
    """
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = _PRAGMA_ONCE.sub("", (KERNEL_DIR / file).read_text())
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def source_define(name: str, macro: str) -> int:
    """The integer value of ``#define macro N`` in source file ``name`` (launch shapes the kernel assumes)."""
    match = re.search(rf"^\s*#\s*define\s+{macro}\s+(\d+)", (KERNEL_DIR / name).read_text(), re.MULTILINE)
    if match is None:
        raise KeyError(f"{name} defines no integer macro {macro}")
    return int(match.group(1))
