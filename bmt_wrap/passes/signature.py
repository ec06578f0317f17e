"""Structural signatures of modules: what makes two modules "the same block".

A signature hashes the class, the child structure, and the names, shapes and dtypes of parameters and
buffers. It reads metadata only, so it works on meta-device models. A module compiled with
``torch.compile(m)`` has the signature of ``m``: compiling some layers of a stack leaves it one stack.
"""

from __future__ import annotations

import hashlib

from torch import nn

from ..base._compat import compiled_inner

#: Two same-class modules whose parameter-name sets overlap at least this much (Jaccard) are
#: "near-identical": T5's block 0 adds one relative-bias table, a ResNet stage's first block a downsample.
NEAR_IDENTICAL_JACCARD = 0.5


def uncompiled(module: nn.Module) -> nn.Module:
    """The module itself, or the module a ``torch.compile(m)`` wrapper holds."""
    inner = compiled_inner(module)
    return module if inner is None else inner


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class SignatureCache:
    """Memoised structural signatures (one walk per model, not one per candidate block)."""

    def __init__(self) -> None:
        self._sig: dict[int, str] = {}
        self._keep: list[nn.Module] = []  # keeps ids stable while the cache lives

    def __call__(self, module: nn.Module) -> str:
        """Hex digest of ``module``'s class, children, parameter and buffer metadata."""
        module = uncompiled(module)
        key = id(module)
        if key not in self._sig:
            parts = [_class_name(module)]
            # Direct tensors only: children contribute through their own signatures.
            for kind, items in (("p", module.named_parameters(recurse=False)),
                                ("b", module.named_buffers(recurse=False))):
                parts += [f"{kind}:{n}:{tuple(t.shape)}:{t.dtype}" for n, t in items]
            parts += [f"c:{n}={self(c)}" for n, c in module.named_children()]
            self._sig[key] = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
            self._keep.append(module)
        return self._sig[key]


def param_names(module: nn.Module) -> frozenset[str]:
    """Relative names of every parameter under ``module`` (tied aliases included)."""
    return frozenset(n for n, _ in module.named_parameters(remove_duplicate=False))


def near_identical(a: nn.Module, b: nn.Module) -> bool:
    """True when ``a`` and ``b`` share a class and most parameter names (shapes may differ)."""
    a, b = uncompiled(a), uncompiled(b)
    if type(a) is not type(b):
        return False
    na, nb = param_names(a), param_names(b)
    if not na or not nb:
        return False
    return len(na & nb) / len(na | nb) >= NEAR_IDENTICAL_JACCARD
