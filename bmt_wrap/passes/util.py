"""Small helpers shared by the passes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def self_checkpointing_modules(model: nn.Module) -> list[str]:
    """Modules that recompute their own layers (transformers' ``gradient_checkpointing_enable()``)."""
    return [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextmanager
def self_checkpointing_suspended(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as it runs once wrapped with checkpointing: its own checkpointing off (tracing through
    ``torch.utils.checkpoint`` fails or records each layer twice); restored on exit."""
    names = self_checkpointing_modules(model)
    for name in names:
        model.get_submodule(name).gradient_checkpointing = False
    try:
        yield
    finally:
        for name in names:
            model.get_submodule(name).gradient_checkpointing = True


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` — enough to say why a capture method was skipped."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
