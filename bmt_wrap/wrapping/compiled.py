"""torch.compile and wrapped models: a block's own code runs compiled inside the executor; the engine never.

The executor wraps each block call in work dynamo cannot trace (gathers, autograd nodes, saved-tensor
hooks), and a checkpointed block's recompute in backward must save what its forward saved, so both must
run the same code: compiled in both or eager in both. Hence (docs/compile.md):

- The engine's entry points (a block's call, the root's forward hooks) are ``torch.compiler.disable``d:
  compiling a whole wrapped model breaks its graph once around each of them instead of tracing the engine,
  and the block's code then runs eagerly in forward and recompute alike.
- A block the user compiled runs its own forward compiled, in forward and recompute alike: after wrapping
  with ``block.compile(...)`` (``CheckpointBlock.compile``), or before wrapping with ``layer.compile(...)``
  or ``torch.compile(layer)``, whose options the wrapper adopts here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..base._compat import compile_context, compiled_inner, drop_compiled_call
from ..errors import WrapError

#: What compiles a callable with the user's options (``torch.compile``'s, bound).
CompileFn = Callable[[Callable[..., Any]], Callable[..., Any]]
F = TypeVar("F", bound=Callable[..., Any])

_NEVER_TRACED: dict[Callable[..., Any], Callable[..., Any]] = {}


def never_traced(fn: F) -> F:
    """``fn`` marked so dynamo never traces it (``torch.compiler.disable``): a compiled caller breaks its graph
    around the call, which runs eagerly. One marked function per ``fn``, made at wrap time, not import
    time: marking imports dynamo, which takes over a second and is loaded anyway once anything compiles.
    Only a closure-free function is remembered (a hook is found again by identity): a closure holds its model,
    and remembering one per wrapped model kept every model's shards alive for the process's life."""
    reason = "bmt_wrap's engine runs eagerly (docs/compile.md)"
    if getattr(fn, "__closure__", None) is not None or not hasattr(fn, "__code__"):
        return torch.compiler.disable(fn, reason=reason)  # type: ignore[return-value]
    if fn not in _NEVER_TRACED:
        _NEVER_TRACED[fn] = torch.compiler.disable(fn, reason=reason)
    return _NEVER_TRACED[fn]  # type: ignore[return-value]


def compiled_wrapper(model: nn.Module, name: str) -> nn.Module | None:
    """The ``torch.compile(m)`` wrapper whose inner module is ``model``'s submodule ``name``, if any."""
    parent_name, _, attr = name.rpartition(".")
    if not attr:
        return None
    parent = model.get_submodule(parent_name)
    return parent if compiled_inner(parent) is model.get_submodule(name) else None


def adopt_compile(module: nn.Module, name: str, wrapper: nn.Module | None = None) -> CompileFn | None:
    """Take over how block ``module`` was compiled before wrapping (``module.compile(...)``, or ``wrapper``
    = ``torch.compile(module)``): its call becomes eager again, so dynamo never traces the executor, and the
    returned function compiles the block's forward with the same options. None when it was not compiled."""
    found: CompileFn | None = None
    for m in (module, wrapper):
        if m is None:
            continue
        try:
            ctx = compile_context(m)
        except LookupError:
            raise WrapError(f"block {name!r} ({type(module).__name__}) was compiled before wrapping, and bmt_wrap "
                            "cannot read its compile options on this torch version. Wrap the plain model first, "
                            "then compile each block: `for layer in model.layers: layer.compile()` "
                            "(docs/compile.md).") from None
        if ctx is not None:
            found = found or ctx  # the block's own compile wins over its wrapper's
            drop_compiled_call(m)
    return found
