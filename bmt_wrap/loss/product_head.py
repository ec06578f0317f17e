"""A vocabulary head that is a product in the model's own code, with no ``nn.Linear`` to replace:
``F.linear(h, self.embed.weight)`` (a tied head, as OLMo and many research models write it),
``h @ self.embed.weight.t()`` or ``.T``, a bare Parameter ``h @ self.lm_head``.

Under ``fused_loss=True`` a training call reads the weight as a ``HeadWeight``: a tensor of the same values
whose product with the hidden states (the kind the plan found) returns ``LazyLogits`` instead of the logits,
and whose transposes stay ``HeadWeight``s. Every other use (the embedding's lookup, a shape read) gets the
weight itself, so the model computes what it computed before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..base._compat import pytree
from .lazy_logits import LazyLogits

_Tensor = torch.Tensor
_MATMULS = frozenset({torch.matmul, _Tensor.matmul, _Tensor.__matmul__, torch.mm, _Tensor.mm})
_SWAPS = frozenset({torch.t, _Tensor.t, _Tensor.T.__get__, _Tensor.mT.__get__})  # type: ignore[attr-defined]
_TRANSPOSES = frozenset({torch.transpose, _Tensor.transpose})
_PERMUTES = frozenset({torch.permute, _Tensor.permute})


class HeadWeight(torch.Tensor):
    """The head's weight (as gathered for this call), or its transpose, read where a product makes logits."""

    _weight: torch.Tensor  # the parameter as the call reads it
    _flipped: bool  # this stands for the parameter transposed (``W.t()``, ``W.T``)
    _kind: str  # "F.linear" or "matmul": the product that makes the logits (passes/fused_loss.py)

    @classmethod
    def of(cls, weight: torch.Tensor, kind: str, flipped: bool = False) -> HeadWeight:
        """``weight`` (transposed when ``flipped``), whose ``kind`` of product makes lazy logits."""
        out = (weight.t() if flipped else weight).detach().as_subclass(cls)  # never computed with: metadata
        out._weight, out._kind, out._flipped = weight, kind, flipped
        return out

    def value(self) -> torch.Tensor:
        """The tensor this stands for, in the autograd graph of the weight."""
        return self._weight.t() if self._flipped else self._weight

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"HeadWeight({self._kind}, flipped={self._flipped}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            lazy = _lazy_product(func, args, kwargs)
            if lazy is not None:
                return lazy
            if args and isinstance(args[0], HeadWeight) and _swaps(func, args[1:], kwargs):
                return HeadWeight.of(args[0]._weight, args[0]._kind, not args[0]._flipped)
        args, kwargs = pytree.tree_map(plain, (args, kwargs))
        return func(*args, **kwargs)


def plain(x: Any) -> Any:
    """``x``, or the tensor a ``HeadWeight`` stands for."""
    return x.value() if isinstance(x, HeadWeight) else x


def _swaps(func: Any, rest: tuple, kwargs: dict) -> bool:
    """True when ``func(weight, *rest)`` transposes the 2-D weight."""
    if kwargs:
        return False
    if func in _SWAPS:
        return not rest
    if func in _TRANSPOSES:
        return len(rest) == 2 and all(isinstance(d, int) for d in rest) and rest[0] % 2 != rest[1] % 2
    if func in _PERMUTES:
        dims = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
        return all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]
    return False


def _hidden(x: Any, width: int) -> bool:
    """True when ``x`` can be the hidden states of a product with a ``width``-wide weight."""
    return (isinstance(x, torch.Tensor) and not isinstance(x, (HeadWeight, LazyLogits)) and x.dim() >= 1
            and x.shape[-1] == width)


def _lazy_product(func: Any, args: tuple, kwargs: dict) -> LazyLogits | None:
    """The lazy logits of a head product (``F.linear(h, W, b)``, ``h @ W.t()``, ``h @ P``); None for any other call."""
    if func is F.linear:
        names = ("input", "weight", "bias")
        given = dict(zip(names, args, strict=False)) | kwargs
        w, h = given.get("weight"), given.get("input")
        if (set(given) <= set(names) and isinstance(w, HeadWeight) and w._kind == "F.linear" and not w._flipped
                and _hidden(h, w.shape[1])):
            return LazyLogits.of(h, w.value(), plain(given.get("bias")))
        return None
    if func in _MATMULS and len(args) == 2 and not kwargs:
        h, w = args
        if isinstance(w, HeadWeight) and w._kind == "matmul" and w.dim() == 2 and _hidden(h, w.shape[0]) and (
                h.dim() == 2 or func not in (torch.mm, _Tensor.mm)):
            # h @ W.t() takes W as F.linear's weight; h @ P, a (hidden, vocabulary) P, takes P.t()
            return LazyLogits.of(h, w._weight if w._flipped else w._weight.t(), None)
    return None
