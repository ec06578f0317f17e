"""Logits not computed yet: what a vocabulary head returns under ``fused_loss=True``.

The model runs its own forward, so the head cannot know whether its output goes to a cross-entropy. It
returns a ``LazyLogits``: a storage-less tensor that holds the hidden states, the weight and the bias,
and records what the model does to it, as long as the chunked op can replay it on each chunk: casts,
reshapes and slices that keep the vocabulary last (applied to the hidden states instead), multiplication
or division by a number, ``tanh``. ``F.cross_entropy`` on it (``nn.CrossEntropyLoss`` and transformers'
losses call it) runs ``linear_cross_entropy``, and the logits are never whole. Anything else computes them
whole, exactly as the unfused head would have (with a ``FusedLossWarning``): correct, only not smaller.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..base._compat import disabled_torch_function, make_wrapper_subclass, pytree
from ..base.fused_loss_plan import index_keeps_last_dim
from ..errors import BMTError, FusedLossWarning
from ..runtime.comm import Communicator
from ..runtime.tp_ops import gather_from_tp
from .linear_cross_entropy import REDUCTIONS, Epilogue, apply_epilogue, compute_dtype, linear_cross_entropy

_Tensor = torch.Tensor
#: Metadata the wrapper tensor answers itself.
_METADATA = frozenset({
    _Tensor.shape.__get__, _Tensor.dtype.__get__, _Tensor.device.__get__, _Tensor.ndim.__get__,  # type: ignore[attr-defined]
    _Tensor.layout.__get__, _Tensor.requires_grad.__get__, _Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    _Tensor.size, _Tensor.dim, _Tensor.numel, _Tensor.is_floating_point, _Tensor.element_size, _Tensor.__len__,
})
_warned: set[str] = set()


class _Source:
    """One head call: its weight and bias (this TP rank's rows of the vocabulary under ``comm``), the autocast
    state it ran under, and whether a loss took it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: str,
                 comm: Communicator | None) -> None:
        self.weight, self.bias, self.device, self.comm = weight, bias, device, comm
        self.vocab = weight.shape[0] * (comm.world_size if comm is not None else 1)
        self.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.consumed = False

    @contextmanager
    def autocast_as_called(self) -> Iterator[None]:
        """Autocast as it was when the head was called."""
        enabled, dtype = self.autocast
        with torch.autocast(self.device, dtype=dtype, enabled=enabled):
            yield


class LazyLogits(torch.Tensor):
    """``epilogue(F.linear(hidden, weight, bias))``, not computed until something needs it whole."""

    _source: _Source
    _hidden: torch.Tensor
    _epilogue: Epilogue

    @staticmethod
    def __new__(cls, source: _Source, hidden: torch.Tensor, epilogue: Epilogue, dtype: torch.dtype) -> LazyLogits:
        shape = torch.Size((*hidden.shape[:-1], source.vocab))
        out = make_wrapper_subclass(cls, shape, dtype, hidden.device, False)
        out._source, out._hidden, out._epilogue = source, hidden, epilogue
        return out

    @classmethod
    def of(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           comm: Communicator | None = None) -> LazyLogits:
        """What ``F.linear(hidden, weight, bias)`` would return, not computed; with ``comm``, every TP rank's
        such product gathered along the vocabulary (``hidden`` comes through ``copy_to_tp``)."""
        source = _Source(weight, bias, hidden.device.type, comm)
        return cls(source, hidden, (), compute_dtype(hidden, weight))

    @property
    def consumed(self) -> bool:
        """True once a cross-entropy took these logits (or others of the same head call)."""
        return self._source.consumed

    def materialize(self) -> torch.Tensor:
        """The logits, whole, with the autograd history the unfused head gives them."""
        source = self._source
        with source.autocast_as_called():
            z = F.linear(self._hidden, source.weight, source.bias)
        if source.comm is not None:
            z = gather_from_tp(z, source.comm, dim=-1)
        return apply_epilogue(z, self._epilogue)

    def _then(self, hidden: torch.Tensor | None = None, step: tuple[str, Any] | None = None) -> LazyLogits:
        dtype = step[1] if step is not None and step[0] == "cast" else self.dtype
        return LazyLogits(self._source, self._hidden if hidden is None else hidden,
                          self._epilogue + ((step,) if step is not None else ()), dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, steps={self._epilogue})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return disabled_torch_function(func, types, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None and isinstance(args[0], LazyLogits):
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _whole(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Every op is answered by __torch_function__ above (or computes the logits whole first).
        raise BMTError(f"{func} reached lazy logits below autograd; please report it. fused_loss=False avoids it")


def _whole(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the logits computed whole."""
    name = getattr(func, "__name__", str(func))
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"fused_loss=True: the vocabulary head's logits met {name}, which the fused loss does not "
                      "replay chunk by chunk, so they were computed whole (the result is the unfused model's; "
                      "the memory is not saved)", FusedLossWarning, stacklevel=3)
    args, kwargs = pytree.tree_map(lambda x: x.materialize() if isinstance(x, LazyLogits) else x, (args, kwargs))
    return func(*args, **kwargs)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scaled(op: str) -> Callable[..., Any]:
    def handler(self: LazyLogits, other: object, *, out: object = None, rounding_mode: object = None) -> Any:
        if not _number(other) or out is not None or rounding_mode is not None:
            return NotImplemented
        return self._then(step=(op, other))
    return handler


def _in_place(op: str) -> Callable[..., Any]:
    def handler(self: LazyLogits, other: object = None) -> Any:
        if op != "tanh" and not _number(other):
            return NotImplemented
        self._epilogue = self._epilogue + ((op, other),)
        return self
    return handler


def _tanh(self: LazyLogits, *, out: object = None) -> Any:
    return NotImplemented if out is not None else self._then(step=("tanh", None))


def _to(self: LazyLogits, *args: Any, **kwargs: Any) -> Any:
    dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.device, str)):
            device = a
        else:
            return NotImplemented
    if kwargs.pop("copy", False) or (device is not None and torch.device(device) != self.device):
        return NotImplemented
    kwargs.pop("non_blocking", None)
    if kwargs:
        return NotImplemented
    return self if dtype is None or dtype == self.dtype else self._then(step=("cast", dtype))


def _float(self: LazyLogits, memory_format: object = None) -> Any:
    return NotImplemented if memory_format is not None else _to(self, torch.float32)


def _reshaped(func: Any) -> Callable[..., Any]:
    def handler(self: LazyLogits, *args: Any, **kwargs: Any) -> Any:
        shape = func(torch.empty(self.shape, device="meta"), *args, **kwargs).shape
        if not shape or shape[-1] != self.shape[-1]:
            return NotImplemented  # the vocabulary would mix with the tokens
        return self._then(hidden=self._hidden.reshape(*shape[:-1], self._hidden.shape[-1]))
    return handler


def _getitem(self: LazyLogits, index: Any) -> Any:
    if not index_keeps_last_dim(index, self.dim()):
        return NotImplemented
    return self._then(hidden=self._hidden[index])


def _contiguous(self: LazyLogits, memory_format: object = None) -> Any:
    return self if memory_format in (None, torch.contiguous_format) else NotImplemented


_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _cross_entropy(*args: Any, **kwargs: Any) -> Any:
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if (logits.dim() != 2 or a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None
            or a["reduction"] not in REDUCTIONS or isinstance(target, LazyLogits)
            or target.shape != logits.shape[:1] or target.is_floating_point()):
        return NotImplemented  # class weights, per-token losses, probabilities as targets: computed whole
    source = logits._source
    with source.autocast_as_called():
        loss = linear_cross_entropy(logits._hidden, source.weight, target, source.bias,
                                    ignore_index=a["ignore_index"], reduction=a["reduction"],
                                    label_smoothing=a["label_smoothing"], epilogue=logits._epilogue,
                                    comm=source.comm)
    source.consumed = True
    return loss


_HANDLERS: dict[Any, Callable[..., Any]] = {
    F.cross_entropy: _cross_entropy,
    _Tensor.float: _float, _Tensor.to: _to, _Tensor.contiguous: _contiguous, _Tensor.__getitem__: _getitem,
    _Tensor.view: _reshaped(_Tensor.view), _Tensor.reshape: _reshaped(_Tensor.reshape),
    _Tensor.flatten: _reshaped(_Tensor.flatten), torch.flatten: _reshaped(torch.flatten),
    torch.reshape: _reshaped(torch.reshape),
    _Tensor.mul: _scaled("mul"), _Tensor.__mul__: _scaled("mul"), _Tensor.__rmul__: _scaled("mul"),
    torch.mul: _scaled("mul"), _Tensor.div: _scaled("div"), _Tensor.__truediv__: _scaled("div"),
    torch.div: _scaled("div"), _Tensor.tanh: _tanh, torch.tanh: _tanh,
    _Tensor.mul_: _in_place("mul"), _Tensor.__imul__: _in_place("mul"), _Tensor.div_: _in_place("div"),
    _Tensor.__itruediv__: _in_place("div"), _Tensor.tanh_: _in_place("tanh"),
}


def drop_or_materialize(tree: Any) -> Any:
    """``tree`` (a model's output) with lazy logits a loss took replaced by None, and others computed whole."""
    def one(x: object) -> object:
        if not isinstance(x, LazyLogits):
            return x
        return None if x.consumed else x.materialize()
    return pytree.tree_map(one, tree)
