"""``ShardedTensor``: a tensor of the original's global shape whose elements are spread over the ranks.

A sharded parameter, its ``.grad`` and optimizer state made from it (``torch.zeros_like(p)``) are all
``ShardedTensor``s. ``shape``, ``ndim``, ``numel()``, ``dtype`` are the full tensor's, so scripts that
look at parameters (weight-decay groups by ``p.dim()``, size counts, ``clip_grad_norm_``) see what they
see on the unwrapped model. Each rank holds one contiguous range of the flattened full tensor: a 1-D
view into its group's flat shard (``to_local()``), so the flat, chunk-major layout needs no copy-in or
copy-out around the collectives (docs/design.md, "Parameters").

Operations run on the local range where that gives the full tensor's answer, and nowhere else:

- elementwise ops (torch's ``pointwise`` tag, ``copy_``/``fill_``/``*_like``, every ``_foreach_`` and
  fused optimizer op) between sharded tensors of one layout, scalars, one-element plain tensors of any
  ndim up to the full shape's, and plain tensors of the full shape (or it less leading 1s; read at this
  rank's range) — what torch's optimizers, ``clip_grad_norm_`` and ``x.div_(x.norm(keepdim=True))`` do;
- random in-place fills (``nn.init.*``) draw the full tensor, as the unwrapped model would, and keep
  this rank's range, so identically seeded ranks hold the same values as plain PyTorch;
- full reductions (``linalg.vector_norm``, ``_foreach_norm``, ``sum``, ``mean``, ``max``, ``min``,
  ``any``, ``all``, ``torch.equal``) are
  collectives: every rank reduces its range and one all-reduce combines them, so every rank gets the
  plain answer. Call them on every rank, like any collective.

- reshapes that keep the flattened order (``view``, ``reshape``, ``flatten``, ``squeeze``/``unsqueeze``) are
  the same range under another full shape: no communication.

Anything else (transposes, matmuls, reductions along a dimension, indexing, broadcasting against a smaller
tensor) gathers the full value of each sharded operand (that parameter's slot only), runs the op on plain
tensors and returns plain tensors; an op that writes into a sharded tensor keeps its range
(``sharded_materialize.py``). Like the reductions, these are collectives: call them on every rank.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..base._compat import (
    UNSAFE_VIEW_OP,
    disabled_torch_function,
    foreach_norm,
    inside_ddp_constructor,
    make_wrapper_subclass,
    pytree,
    register_foreach_type,
)
from ..base.plan import FlatBufferSpec
from ..errors import ShardedTensorError
from . import offload
from .comm import Communicator, StagePlacement
from .sharded_materialize import run_on_full_values

aten = torch.ops.aten


class ShardStorage(Protocol):
    """What a layout reads from the flat buffer its range lives in (``flat_buffer.FlatBuffer``, a layer up)."""

    spec: FlatBufferSpec
    shard_numel: int
    full_numel: int
    local_ranges: list[tuple[int, int]]
    stage: StagePlacement | None  # under pipeline parallelism: the stage holding the values, else None

    @property
    def comm(self) -> Communicator:
        """The communicator of the buffer's group."""

    def slot_source_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of slot ``i``'s flattened tensor that this rank (or ``rank``) holds."""


class ShardLayout:
    """Which elements of a full tensor this rank holds: slot ``slot`` of ``buffer``, fixed at wrap time."""

    __slots__ = ("_buffer", "slot", "full_shape", "start", "end", "name", "tp")

    def __init__(self, buffer: ShardStorage, slot: int) -> None:
        # Held weakly: a parameter's ``.grad`` carries this layout, and torch holds ``.grad`` in C++, out of
        # the garbage collector's sight, so a strong reference would close a cycle (grad, layout, buffer,
        # parameter, grad) that keeps a dropped model's every shard alive for the process's life.
        self._buffer = weakref.ref(buffer)
        self.slot = slot
        spec = buffer.spec.slots[slot]
        self.full_shape = torch.Size(spec.shape)
        self.start, self.end = buffer.slot_source_range(slot)
        self.name = spec.fqn
        # The tensor-parallel group when this slot is one TP rank's slice of a larger tensor (set by the
        # engine from the TP marks): norms then also combine over it, so clip_grad_norm_ sees the whole.
        self.tp: Communicator | None = None

    @property
    def buffer(self) -> ShardStorage:
        """The flat buffer holding this slot; raises once its model is gone."""
        buffer = self._buffer()
        if buffer is None:
            raise ShardedTensorError(f"{self.name!r}: the wrapped model this tensor belongs to was deleted, so its shards "
                            "are gone. Keep the model alive while using its parameters or gradients, or copy "
                            "what you need (bmt.save, or .full_tensor() before dropping it).")
        return buffer

    def same_as(self, other: ShardLayout) -> bool:
        """Whether two tensors of these layouts hold the same elements on this rank."""
        return other is self or (other.full_shape == self.full_shape
                                 and (other.start, other.end) == (self.start, self.end))

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's range of a full tensor (a view when ``full`` is contiguous)."""
        return full.reshape(-1)[self.start:self.end]

    def reshaped(self, shape: torch.Size) -> ShardLayout:
        """The same range of the same elements seen as a tensor of ``shape`` (same numel, same order)."""
        other = object.__new__(ShardLayout)
        for name in ShardLayout.__slots__:
            setattr(other, name, getattr(self, name))
        other.full_shape = torch.Size(shape)
        return other

    @property
    def stage(self) -> StagePlacement | None:
        """The pipeline stage holding this tensor's values (None: every stage holds them, or no pipeline)."""
        return self.buffer.stage

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor (a fresh one) from every rank's ``local`` range: a collective over the shard
        group that moves this slot's pieces only, never the rest of the flat buffer; under pipeline
        parallelism, then one broadcast from the stage holding it over the pipe group."""
        stage = self.stage
        if stage is None:
            return self._gather_in_stage(local)
        full = self._gather_in_stage(local) if stage.here else local.new_empty(self.full_shape)
        if full.numel():
            stage.pp.broadcast(full.view(-1), stage.owner, label=f"{self.name} full value")
        return full

    def _gather_in_stage(self, local: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        comm = b.comm
        n = comm.world_size
        if n == 1 or self.full_shape.numel() == 0:
            return local.reshape(self.full_shape).clone()
        sizes = [e - s for s, e in (b.slot_source_range(self.slot, r) for r in range(n))]
        holders = [r for r in range(n) if sizes[r] > 0]
        label = f"{self.name} full value"
        if len(holders) == 1:  # the whole slot on one rank: one broadcast, no padding
            full = local.clone() if comm.rank == holders[0] else local.new_empty(self.full_shape.numel())
            comm.broadcast(full, holders[0], label=label)
            return full.view(self.full_shape)
        piece = max(sizes)
        send = local.new_empty(piece)
        send[:local.numel()].copy_(local)
        out = local.new_empty(n * piece)
        comm.all_gather_into(out, send, label=label)
        return torch.cat([out[r * piece:r * piece + sizes[r]] for r in holders]).view(self.full_shape)

    def all_reduce(self, t: torch.Tensor, op: str, what: str) -> None:
        """Combine every rank's partial result ``t`` in place (under pipeline parallelism, over the stages
        too: the others hold an empty range, a neutral part)."""
        comm = self.buffer.comm
        if comm.world_size > 1:
            comm.all_reduce(t, op, label=f"{what} of sharded {self.name}")
        stage = self.stage
        if stage is not None:
            if not stage.here:  # another holder of a shared buffer answers for it: count its part once
                t.fill_(0 if op == "sum" else math.inf if op == "min" else -math.inf)
            stage.pp.all_reduce(t, op, label=f"{what} of {self.name} over the stages")

    @property
    def whole_on_rank(self) -> bool:
        """Whether this rank's range is the whole tensor (one shard rank, no TP split, no other stage): no
        collective."""
        return self.buffer.comm.world_size == 1 and self.tp is None and self.stage is None


class ShardedTensor(torch.Tensor):
    """A tensor of global shape ``layout.full_shape`` holding this rank's range as ``to_local()``."""

    _local: torch.Tensor
    _layout: ShardLayout
    __torch_function__ = disabled_torch_function  # ops reach __torch_dispatch__ with plain semantics

    @staticmethod
    def _wrap(cls: type, local: torch.Tensor, layout: ShardLayout, requires_grad: bool = False) -> Any:
        t = make_wrapper_subclass(cls, layout.full_shape, local.dtype, local.device, requires_grad)
        t._local = local
        t._layout = layout
        return t

    @classmethod
    def wrap(cls, local: torch.Tensor, layout: ShardLayout) -> ShardedTensor:
        """``local`` (this rank's range, 1-D) as a tensor of the layout's full shape."""
        if local.dim() != 1 or local.numel() != layout.end - layout.start:
            raise ShardedTensorError(f"a local range of {layout.name!r} has {layout.end - layout.start} elements; "
                                     f"got a tensor of shape {tuple(local.shape)}")
        return ShardedTensor._wrap(ShardedTensor, local, layout)

    def __hash__(self) -> int:
        # Tensor.__hash__ is id(self), but reached through torch-function handling: ~15 us per call, and
        # optimizers look their state up by parameter several times per step.
        return id(self)

    def to_local(self) -> torch.Tensor:
        """This rank's elements: a 1-D view of the flattened full tensor's range ``[start, end)``."""
        return self._local

    @property
    def shard_layout(self) -> ShardLayout:
        """Which elements this rank holds."""
        return self._layout

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered from every rank (a collective: call it on every rank)."""
        return self._layout.gather(self._local.detach())

    def numpy(self, *, force: bool = False) -> Any:
        """The values as a NumPy array where this rank holds every element (one rank, or a group of one: a
        BMTrain test at data-parallel size 1 reads gradients so); otherwise ``ShardedTensorError``."""
        lay = self._layout
        if lay.start != 0 or lay.end != self.numel():
            raise ShardedTensorError(f"{lay.name!r} holds elements [{lay.start}, {lay.end}) of {self.numel()} on "
                                     "this rank: call .full_tensor().numpy() (a collective) for the whole tensor")
        return self._local.detach().view(self.shape).numpy(force=force)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        lay = self._layout
        return (f"ShardedTensor({lay.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"local elements [{lay.start}, {lay.end}))")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise ShardedTensorError(
            f"cannot pickle sharded tensor {self._layout.name!r} (one rank's range): save with "
            "p.full_tensor() or p.to_local(), bmt.save(model, path) or torch.distributed.checkpoint")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            handler = _HANDLERS[func] = _handler_for(func)
        out = handler(func, args, kwargs or {})
        if offload.active():
            _note_offloaded(args)
        return out


# ---- the rules ------------------------------------------------------------------------------------------
_ELEMENTWISE = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
                aten._to_copy.default, aten.clone.default, aten.zeros_like.default, aten.ones_like.default,
                aten.empty_like.default, aten.full_like.default, aten.masked_fill_.Scalar,
                aten.masked_fill_.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
# Views of a contiguous tensor that keep its flattened order: a flattened ShardedTensor is the same range.
_ORDER_KEEPING_VIEWS = {aten.view.default, UNSAFE_VIEW_OP, aten.reshape.default,
                        aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
                        aten.squeeze.dims, aten.unsqueeze.default}
_RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
                 aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.cauchy_.default,
                 aten.log_normal_.default, aten.geometric_.default}


def _handler_for(func: Any) -> Callable[[Any, tuple, dict], Any]:
    """How ``func`` runs on sharded tensors (decided once per op: dispatch is on every optimizer op's path)."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special
    if func._schema.name == "aten::_foreach_max":  # a max per tensor: no local answer
        return _materialize
    if func._schema.name.startswith(("aten::_foreach_", "aten::_fused_")):
        return _foreach
    if func in _RANDOM_FILLS:
        return _random_fill
    if func in _ORDER_KEEPING_VIEWS:
        return _reshape_view
    if torch.Tag.pointwise in func.tags or func in _ELEMENTWISE:
        return _in_place if func._schema.is_mutable else _elementwise
    return _materialize


class _NotLocal(Exception):
    """An op's operands do not line up on this rank's range: it needs the full values."""


def _materialize(func: Any, args: tuple, kwargs: dict) -> Any:
    if inside_ddp_constructor():
        raise _unsupported(func, args, kwargs)
    return run_on_full_values(func, args, kwargs, ShardedTensor)


_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


def _first_sharded(leaves: list[Any]) -> ShardedTensor | None:
    return next((x for x in leaves if isinstance(x, ShardedTensor)), None)


def _unsupported(func: Any, args: tuple, kwargs: dict, why: str = "") -> ShardedTensorError:
    leaves, _ = pytree.tree_flatten((args, kwargs))
    ref = _first_sharded(leaves)
    name = ref._layout.name if ref is not None else "?"
    if inside_ddp_constructor():
        return ShardedTensorError(
            "DistributedDataParallel was put around a wrapped model: the wrapper already averages gradients "
            f"across ranks, and each rank holds only a range of every parameter ({name!r}), which DDP cannot "
            "broadcast. Use the model without DDP. Tools that add DDP by themselves have bmt_wrap versions: "
            "bmt_wrap.integrations.transformers.Trainer, bmt_wrap.integrations.accelerate.Accelerator, "
            "pl.Trainer(strategy=bmt_wrap.integrations.lightning.ShardedStrategy()).")
    return ShardedTensorError(
        f"{func} is not supported on sharded parameter {name!r} (each rank holds only a range of it{why}). "
        "Parameters of a wrapped model support elementwise ops, norms and full reductions (what optimizers "
        "and clip_grad_norm_ use); for anything else read full values with p.full_tensor() (a collective) "
        "or `with bmt.gathered(model):`")


def _local_arg(x: Any, layout: ShardLayout, func: Any, args: tuple, kwargs: dict) -> Any:
    """One argument of an elementwise op, as the local op needs it."""
    if isinstance(x, ShardedTensor):
        if x._layout is not layout and not x._layout.same_as(layout):
            raise _NotLocal  # another range or another shape: broadcasting needs the full values
        return x._local
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    full = layout.full_shape
    if x.dim() > len(full):
        raise _NotLocal  # broadcasting widens the result: its shape is not the full shape
    if x.shape == full[len(full) - x.dim():] and x.numel() == full.numel():
        return layout.local_of_full(x)  # the full shape, or it less leading 1s: the same flattened order
    if x.numel() == 1:
        # One value for every element; as it is, it would broadcast the 1-D range to its ndim (in place:
        # an error). 1-D, not 0-d: dtype promotion treats a dimensioned operand unlike a 0-d one.
        return x.reshape(1)
    raise _NotLocal  # broadcasting against a smaller tensor


def _local_call(func: Any, args: tuple, kwargs: dict) -> tuple[Any, ShardLayout]:
    """Run an elementwise op (flat arguments: tensors, scalars, options) on local ranges."""
    ref = _first_sharded(args)
    if ref is None:
        ref = _first_sharded(list(kwargs.values()))
    assert ref is not None
    layout = ref._layout
    local_args = [_local_arg(x, layout, func, args, kwargs) if isinstance(x, torch.Tensor) else x for x in args]
    if not kwargs:  # the common case: skip building a second container
        return func(*local_args), layout
    local_kwargs = {k: _local_arg(v, layout, func, args, kwargs) if isinstance(v, torch.Tensor) else v
                    for k, v in kwargs.items()}
    return func(*local_args, **local_kwargs), layout


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        out, layout = _local_call(func, args, kwargs)
    except _NotLocal:
        return _materialize(func, args, kwargs)
    if not isinstance(out, torch.Tensor) or out.shape != (layout.end - layout.start,):
        return _materialize(func, args, kwargs)  # broadcast to another shape
    return ShardedTensor._wrap(ShardedTensor, out, layout)


def _in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    if not isinstance(args[0], ShardedTensor):  # writing into a plain tensor reads the full values
        return _materialize(func, args, kwargs)
    try:
        _local_call(func, args, kwargs)
    except _NotLocal:
        return _materialize(func, args, kwargs)
    return args[0]


def _wrap_like(out: torch.Tensor, layout: ShardLayout) -> ShardedTensor:
    return ShardedTensor._wrap(ShardedTensor, out, layout)


def _all_local(lists: list[Any]) -> list[list[torch.Tensor]] | None:
    """The local ranges of lists of sharded tensors whose layouts match index by index (what optimizers
    and ``clip_grad_norm_`` pass: a parameter's gradient and state share its layout object), or None."""
    try:
        first = [t._layout for t in lists[0]]
        for lst in lists[1:]:
            if any(t._layout is not lay for t, lay in zip(lst, first, strict=True)):
                return None
        return [[t._local for t in lst] for lst in lists]
    except (AttributeError, ValueError):  # a plain tensor among them, or lists of other lengths
        return None


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """A multi-tensor op: lists are matched index by index; each index keeps its own layout."""
    lists = [a for a in args if _is_tensor_list(a)]
    fast = _all_local(lists) if not any(_is_tensor_list(v) or isinstance(v, ShardedTensor)
                                        for v in kwargs.values()) else None
    if fast is not None and not any(isinstance(a, ShardedTensor) for a in args):
        it = iter(fast)
        out = func(*[next(it) if _is_tensor_list(a) else a for a in args], **kwargs)
        if func._schema.is_mutable:
            return None if out is None else args[0]
        if all(o.shape == t.shape for o, t in zip(out, fast[0], strict=True)):
            return [ShardedTensor._wrap(ShardedTensor, o, t._layout) for o, t in zip(out, lists[0], strict=True)]
    return _foreach_mixed(func, args, kwargs, lists)


def _foreach_mixed(func: Any, args: tuple, kwargs: dict, lists: list[Any]) -> Any:
    layouts: list[ShardLayout | None] = []
    for i in range(len(lists[0])):
        ref = _first_sharded([lst[i] for lst in lists])
        layouts.append(ref._layout if ref is not None else None)

    def local(x: Any) -> Any:
        if isinstance(x, ShardedTensor):  # one sharded tensor where a scalar belongs
            raise _NotLocal
        if not _is_tensor_list(x):
            return x
        return [t if lay is None else _local_arg(t, lay, func, args, kwargs) for t, lay in zip(x, layouts, strict=True)]

    mutable = func._schema.is_mutable
    if mutable and any(lay is not None and not isinstance(t, ShardedTensor)
                       for t, lay in zip(args[0], layouts, strict=True)):
        return _materialize(func, args, kwargs)  # writing into plain tensors reads full values
    try:
        local_args = [local(a) for a in args]
        local_kwargs = {k: local(v) for k, v in kwargs.items()}
    except _NotLocal:
        return _materialize(func, args, kwargs)
    out = func(*local_args, **local_kwargs)
    if mutable:
        return None if out is None else args[0]
    if any(lay is not None and o.shape != (lay.end - lay.start,)
           for o, lay in zip(out, layouts, strict=True)):
        return _materialize(func, args, kwargs)
    return [o if lay is None else _wrap_like(o, lay) for o, lay in zip(out, layouts, strict=True)]


def _unscale_and_check(func: Any, args: tuple, kwargs: dict) -> None:
    """GradScaler's unscale and inf/nan check: local on each range, then one all-reduce of the flag, so
    every rank skips the same steps."""
    _foreach(func, args, kwargs)
    grads, found_inf = args[0], args[1]
    # Over every group of ranks the gradients are sharded over (under TP: the shard group, and shard x tp
    # for whole parameters), in first-seen order, the same on every rank.
    comms: dict[int, Communicator] = {}
    for g in grads:
        if isinstance(g, ShardedTensor):
            comms.setdefault(id(g._layout.buffer.comm), g._layout.buffer.comm)
    for comm in comms.values():
        if comm.world_size > 1:
            comm.all_reduce(found_inf.view(1), "max", label="inf/nan flag")
    staged = next((g._layout.stage for g in grads if isinstance(g, ShardedTensor) and g._layout.stage), None)
    if staged is not None:  # every stage skips the step when one stage overflowed
        staged.pp.all_reduce(found_inf.view(1), "max", label="inf/nan flag over the stages")


def _note_offloaded(args: tuple) -> None:
    """Offloaded operands of an op outside the engine's schedule (a torch optimizer's, user code's): their
    pages leave memory once more than ``offload.TOUCHED_BUDGET`` of them are mapped."""
    for a in args:
        if isinstance(a, ShardedTensor):
            offload.note_touched(a._local)
        elif _is_tensor_list(a):
            for t in a:
                if isinstance(t, ShardedTensor):
                    offload.note_touched(t._local)


def _is_tensor_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], torch.Tensor)


def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    """Draw the whole tensor, as the unwrapped model would, and keep this rank's range."""
    target = args[0]
    if not isinstance(target, ShardedTensor):
        raise _unsupported(func, args, kwargs)
    lay = target._layout
    full = torch.empty(lay.full_shape, dtype=target.dtype, device=target._local.device)
    func(full, *args[1:], **kwargs)
    target._local.copy_(lay.local_of_full(full))
    return target


def _alias(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    t = args[0]
    return ShardedTensor.wrap(func(t._local), t._layout)


def _reshape_view(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    """A view that keeps the flattened order (``view(-1)``, ``flatten``, ``unsqueeze`` ...): the same range
    under another full shape, no communication."""
    t = args[0]
    shape = func(torch.empty(t.shape, device="meta"), *args[1:], **kwargs).shape  # torch's own size rules
    layout = t._layout if shape == t.shape else t._layout.reshaped(shape)
    return ShardedTensor.wrap(t._local.view(-1), layout)


def _powers(local: torch.Tensor, p: float, dtype: torch.dtype | None) -> torch.Tensor:
    """This rank's part of a p-norm before the root: ``sum |x|^p`` (``max |x|`` for inf), float64."""
    x = local if dtype is None else local.to(dtype)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=local.device)
    if math.isinf(p):
        return x.abs().max().double()
    if p == 0:
        return (x != 0).sum().double()
    return torch.linalg.vector_norm(x, p).double() ** p


def _finish_norms(parts: torch.Tensor, p: float) -> torch.Tensor:
    return parts if math.isinf(p) or p == 0 else parts ** (1.0 / p)


def _reduce_parts(parts: torch.Tensor, tensors: list, op: str) -> None:
    """Combine the norm parts of sharded ``tensors`` over the ranks each is sharded over, in place: one
    all-reduce per group of ranks (under TP, whole parameters are sharded over shard x tp ranks, split
    ones over the shard group), in first-seen order, the same on every rank."""
    by_comm: dict[int, tuple[Communicator, list[int]]] = {}
    for i, t in enumerate(tensors):
        comm = t._layout.buffer.comm
        by_comm.setdefault(id(comm), (comm, []))[1].append(i)
    if len(by_comm) == 1:
        comm = next(iter(by_comm.values()))[0]
        if comm.world_size > 1:
            comm.all_reduce(parts, op, label=f"norms of sharded {tensors[0]._layout.name}")
        return
    for comm, idx in by_comm.values():
        if comm.world_size > 1:
            sub = parts.reshape(-1)[idx].clone()
            comm.all_reduce(sub, op, label=f"norms of {len(idx)} sharded tensor(s)")
            parts.reshape(-1)[idx] = sub


def _combine_tp_parts(parts: torch.Tensor, tensors: list, p: float) -> None:
    """Combine the norm parts of TP-split tensors (already combined over the shard group) over their TP
    group, in place: each TP rank holds one slice, so the whole tensor's norm needs every slice. One
    all-reduce for the list; TP peers hold the same parameters, so every peer issues it."""
    split = [i for i, t in enumerate(tensors) if t._layout.tp is not None]
    if not split:
        return
    tp = tensors[split[0]]._layout.tp
    sub = parts.reshape(-1)[split].clone()
    tp.all_reduce(sub, "max" if math.isinf(p) else "sum", label=f"norms of {len(split)} TP-split tensor(s)")
    parts.reshape(-1)[split] = sub


def _combine_pp_parts(parts: torch.Tensor, tensors: list, p: float) -> None:
    """Combine the norm parts of tensors one pipeline stage holds (already complete on that stage) over
    the pipe group, in place: the other stages hold empty ranges. One all-reduce for the list; every rank
    holds the same list (ghosts of other stages' parameters included), so every stage issues it."""
    staged = [i for i, t in enumerate(tensors) if t._layout.stage is not None]
    if not staged:
        return
    pp = tensors[staged[0]]._layout.stage.pp
    sub = parts.reshape(-1)[staged].clone()
    sub[[not tensors[i]._layout.stage.here for i in staged]] = 0  # a shared buffer counts on its owner only
    pp.all_reduce(sub, "max" if math.isinf(p) else "sum", label=f"norms of {len(staged)} tensor(s) over the stages")
    parts.reshape(-1)[staged] = sub


def _vector_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    t = args[0]
    p = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2.0))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if (dim is not None and sorted(d % t.dim() for d in dim) != list(range(t.dim()))) or keepdim or p < 0:
        return _materialize(func, args, kwargs)  # a norm along some dimensions
    if t._layout.whole_on_rank:
        return torch.linalg.vector_norm(t._local, p, dtype=dtype)
    part = _powers(t._local, p, dtype).reshape(1)
    comm = t._layout.buffer.comm
    if comm.world_size > 1:
        comm.all_reduce(part, "max" if math.isinf(p) else "sum", label=f"norm of sharded {t._layout.name}")
    _combine_tp_parts(part, [t], p)
    _combine_pp_parts(part, [t], p)
    out_dtype = dtype or t.dtype
    return _finish_norms(part, p)[0].to(out_dtype)


def _foreach_norm(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    tensors = args[0]
    p = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2.0))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    fast = _all_local([tensors])
    if (fast is not None and len({t.dtype for t in fast[0]}) == 1
            and (not math.isinf(p) or all(t.numel() for t in fast[0]))):
        # Every tensor sharded: one foreach kernel on the ranges, one all-reduce for the whole list.
        parts = torch.stack(foreach_norm(fast[0], p, dtype)).double()
        if not (math.isinf(p) or p == 0):
            parts = parts ** p
        _reduce_parts(parts, tensors, "max" if math.isinf(p) else "sum")
        _combine_tp_parts(parts, tensors, p)
        _combine_pp_parts(parts, tensors, p)
        return list(_finish_norms(parts, p).to(dtype or tensors[0].dtype).unbind())
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, ShardedTensor)]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    plain = [i for i in range(len(tensors)) if i not in set(sharded)]
    if plain:
        for i, v in zip(plain, foreach_norm([tensors[i] for i in plain], p, dtype), strict=True):
            out[i] = v
    if sharded:
        # One all-reduce for the whole list: the norm of every sharded tensor at once.
        parts = torch.stack([_powers(tensors[i]._local, p, dtype) for i in sharded])
        _reduce_parts(parts, [tensors[i] for i in sharded], "max" if math.isinf(p) else "sum")
        _combine_tp_parts(parts, [tensors[i] for i in sharded], p)
        _combine_pp_parts(parts, [tensors[i] for i in sharded], p)
        for i, v in zip(sharded, _finish_norms(parts, p), strict=True):
            out[i] = v.to(dtype or tensors[i].dtype)
    return out  # type: ignore[return-value]


def _full_reduction(op: str) -> Callable[[Any, tuple, dict], torch.Tensor]:
    def reduce(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        t = args[0]
        if len(args) > 1 or any(k != "dtype" for k in kwargs):
            return _materialize(func, args, kwargs)  # a reduction along some dimensions
        local = t._local if "dtype" not in kwargs else t._local.to(kwargs["dtype"])
        if op == "sum" or op == "mean":
            part = local.sum().reshape(1).double()
        elif local.numel() == 0:
            part = torch.full((1,), -math.inf if op == "max" else math.inf, dtype=torch.float64, device=local.device)
        else:
            part = (local.max() if op == "max" else local.min()).reshape(1).double()
        t._layout.all_reduce(part, "sum" if op == "mean" else op, op)
        if op == "mean":
            part = part / t.numel()
        return part[0].to(local.dtype if op != "mean" else local.dtype)
    return reduce


def _everywhere(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.equal`` / ``torch.allclose``: each rank compares its range, one all-reduce; every rank gets
    the same answer (``equal`` is False for another shape or dtype, as torch's)."""
    a, b = args[0], args[1]
    if func is aten.equal.default and (a.shape != b.shape or a.dtype != b.dtype):
        return False
    ref = a if isinstance(a, ShardedTensor) else b
    lay = ref._layout
    try:
        la, lb = _local_arg(a, lay, func, args, kwargs), _local_arg(b, lay, func, args, kwargs)
    except _NotLocal:
        return _materialize(func, args, kwargs)
    agree = torch.tensor([1.0 if func(la, lb, *args[2:], **kwargs) else 0.0], device=ref._local.device)
    lay.all_reduce(agree, "min", func.__name__.split(".")[0])
    return bool(agree.item() == 1.0)


def _any_all(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``t.any()`` / ``t.all()`` over every rank's range (one all-reduce; an empty range is neutral)."""
    t = args[0]
    if len(args) > 1 or kwargs:
        return _materialize(func, args, kwargs)  # along some dimensions
    local = bool(func(t._local)) if t._local.numel() else func is aten.all.default
    flag = torch.tensor([1.0 if local else 0.0], device=t._local.device)
    t._layout.all_reduce(flag, "max" if func is aten.any.default else "min", "any/all")
    return torch.tensor(bool(flag.item() == 1.0), device=t._local.device)


def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return args[0].shape == args[1].shape


def _new_factory(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``t.new_zeros(size)`` and kin: a plain tensor of the given size, like ``t``'s dtype and device."""
    return func(args[0]._local, *args[1:], **kwargs)


_SPECIAL: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale_and_check,
    aten.sum.default: _full_reduction("sum"),
    aten.mean.default: _full_reduction("mean"),
    aten.max.default: _full_reduction("max"),
    aten.min.default: _full_reduction("min"),
    aten.any.default: _any_all,
    aten.all.default: _any_all,
    aten.is_same_size.default: _is_same_size,
    aten.equal.default: _everywhere,
    aten.allclose.default: _everywhere,
    aten.new_zeros.default: _new_factory,
    aten.new_ones.default: _new_factory,
    aten.new_empty.default: _new_factory,
    aten.new_full.default: _new_factory,
}

# torch's optimizers and clip_grad_norm_ take their multi-tensor paths only for listed types (DTensor
# registers itself the same way): one _foreach_norm is one all-reduce instead of one per parameter.
register_foreach_type(ShardedTensor)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a sharded tensor; any other tensor as it is."""
    return t._local if isinstance(t, ShardedTensor) else t
