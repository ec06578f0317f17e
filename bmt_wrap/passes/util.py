"""Small helpers shared by the passes."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` — enough to say why a capture method was skipped."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
