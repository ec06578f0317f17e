"""What a checkpointed block's recompute needs to replay its forward faithfully (docs/design.md: recompute is
invisible to the user).

A block's forward may change more than its outputs: it may fill a non-tensor argument (a transformers
``DynamicCache``: ``update()`` appends this layer's keys and values) or update its buffers (BatchNorm's
running statistics). Replayed against that changed state, the recompute would see a cache already
holding the sequence (attention over twice the keys: wrong gradients) and update the statistics twice.

So before the forward, a ``Replay`` takes a structural copy of every mutable non-tensor argument (the
Python objects are copied, tensors shared, so a cache of any length costs a few object copies). An
argument tensor is cloned only if the block writes it: the first call watches the forward's ops and
clones a tensor just before its first write (copy on write), later calls clone the ones earlier calls
wrote. Nothing else is copied, so what a call keeps for its recompute does not grow with the blocks
before it (layer i's arguments reach the cache of all i earlier layers; cloning them all was quadratic
in depth). A block's own buffers are cloned before its first call and the copies of those the forward
left alone are dropped after it (kernels may write them without telling: batch norm's statistics). The
recompute runs on those copies and the copies are thrown away, so nothing the user can see changes
twice. Tensors the forward stored into an argument (the cache's new keys) need nothing: the forward ran
in the model's own graph, so they carry gradients as in plain PyTorch. What cannot be replayed (a tensor
inside an argument written in place by a later call only, or behind torch's back, an object that cannot
be copied) raises ``RecomputeError`` naming the block, never a wrong gradient.
"""

from __future__ import annotations

import copy
import enum
import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..base._compat import tensor_version, watch_writes
from ..errors import RecomputeError

Path = tuple[tuple[str, Any], ...]
_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout, enum.Enum, range, slice, type(Ellipsis), type(NotImplemented))
# Shared, never copied: tensors are the data, the rest are code or model structure, not step state.
_SHARED = (torch.Tensor, nn.Module, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.ModuleType, type, functools.partial, torch.Generator)
_MAX_OBJECTS = 100_000


def is_mutable_leaf(x: Any) -> bool:
    """True for a pytree leaf the forward could change in place (not a tensor, atom or shared object)."""
    return not isinstance(x, _ATOMS + _SHARED)


class ReplayMemory:
    """What one block learned from its earlier calls: which buffers and argument tensors it writes."""

    def __init__(self) -> None:
        self.calls = 0
        self.written_buffers: set[tuple[int, str]] = set()  # (id(module), buffer name)
        self.written_paths: set[Path] = set()  # argument tensors written in place (copied before forward)


class _Copier:
    """Copies a Python object graph, sharing tensors (except the ones at ``clone_paths``)."""

    def __init__(self, block: str, clone_all: bool, clone_paths: set[Path]) -> None:
        self.block, self.clone_all, self.clone_paths = block, clone_all, clone_paths
        self.memo: dict[int, Any] = {}
        self.seen: list[tuple[Path, torch.Tensor, int]] = []  # every tensor reached, with its version
        self.clones: dict[Path, torch.Tensor] = {}
        self.count = 0

    def copy(self, x: Any, path: Path) -> Any:
        if isinstance(x, torch.Tensor):
            self.seen.append((path, x, tensor_version(x)))
            if self.clone_all or path in self.clone_paths:
                self.clones[path] = x.detach().clone()
                return self.clones[path]
            return x
        if isinstance(x, _ATOMS + _SHARED):
            return x
        if id(x) in self.memo:
            return self.memo[id(x)]
        self.count += 1
        if self.count > _MAX_OBJECTS:
            raise RecomputeError(f"block {self.block!r}: an argument reaches more than {_MAX_OBJECTS} Python "
                              f"objects (at {_describe(path)}), too many to copy for the recompute. Pass "
                              "such state another way, or turn checkpointing off for this block "
                              "(BMTrainModelWrapper(model, checkpoint=False) or the plan's checkpoint flag).")
        if isinstance(x, tuple):
            y: Any = _remake_tuple(x, [self.copy(v, path + (("idx", i),)) for i, v in enumerate(x)])
            self.memo[id(x)] = y
            return y
        try:
            y = copy.copy(x)
        except Exception as exc:
            raise RecomputeError(f"block {self.block!r}: argument {_describe(path)} ({type(x).__name__}) cannot be "
                              f"copied for the recompute ({exc}). Turn checkpointing off for this block "
                              "(BMTrainModelWrapper(model, checkpoint=False) or the plan's checkpoint flag).") from exc
        self.memo[id(x)] = y
        if isinstance(x, list):
            y[:] = [self.copy(v, path + (("idx", i),)) for i, v in enumerate(x)]
        elif isinstance(x, dict):
            for k in list(y):
                y[k] = self.copy(x[k], path + (("key", k),))
        elif isinstance(x, (set, frozenset)):
            pass  # members are hashable, so not mutable step state worth copying
        else:
            for k, v in list(getattr(x, "__dict__", {}).items()):
                y.__dict__[k] = self.copy(v, path + (("attr", k),))
        return y


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                                        and torch.equal(a.nan_to_num(), b.nan_to_num())))


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # no storage (sparse, nested, fake): nothing an op could write behind a path
        return None


def _remake_tuple(x: tuple, items: list[Any]) -> tuple:
    return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)


def _describe(path: Path) -> str:
    text = f"argument {path[0][1]}" if path else "argument"
    for kind, key in path[1:]:
        text += f".{key}" if kind == "attr" else f"[{key!r}]"
    return text


def _put(x: Any, path: Path, value: Any) -> Any:
    """``x`` with the object at ``path`` replaced by ``value`` (in place; tuples on the way are rebuilt)."""
    if not path:
        return value
    (kind, key), rest = path[0], path[1:]
    child = getattr(x, key) if kind == "attr" else x[key]
    new = _put(child, rest, value)
    if new is child:
        return x
    if isinstance(x, tuple):
        items = list(x)
        items[key] = new
        return _remake_tuple(x, items)
    if kind == "attr":
        object.__setattr__(x, key, new)
    else:
        x[key] = new
    return x


class Replay:
    """The state one checkpointed call's recompute runs against; see the module docstring."""

    def __init__(self, block: str, module: nn.Module, leaves: list[Any], memory: ReplayMemory,
                 watch: bool = True) -> None:
        self.block, self.memory = block, memory
        self.mutable = [i for i, x in enumerate(leaves) if is_mutable_leaf(x)]
        self.first = memory.calls == 0
        # A compiled forward under a dispatch watch runs other kernels than its recompute (dynamo falls
        # back): such a block's first call clones everything reachable, as before, and compares values.
        self.watch = watch
        memory.calls += 1
        copier = _Copier(block, clone_all=self.first and not watch, clone_paths=memory.written_paths)
        self.copies = {i: copier.copy(leaves[i], (("leaf", i),)) for i in self.mutable}
        self._seen = copier.seen
        self._clones = copier.clones
        self._unwritten: dict[int, list[tuple[Path, torch.Tensor]]] = {}  # storage -> seen tensors not cloned yet
        self._find_hidden()
        self.buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
        self._buffer_versions = [tensor_version(b) for _, _, b in self.buffers]
        self.buffer_copies = {i: b.detach().clone() for i, (m, name, b) in enumerate(self.buffers)
                              if self.first or (id(m), name) in memory.written_buffers}

    def _find_hidden(self) -> None:
        by_id: dict[int, tuple[torch.Tensor, list[Path]]] = {}
        for path, t, _ in self._seen:
            if t.requires_grad:
                by_id.setdefault(id(t), (t, []))[1].append(path)
        self._hidden = list(by_id.values())

    def hidden(self) -> list[torch.Tensor]:
        """Tensors needing grad inside non-tensor arguments (earlier blocks' cache entries): the recompute
        reads detached copies of them, so it builds no graph into the blocks that made them."""
        return [t for t, _ in self._hidden]

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Around the forward: on the first call, clone each argument tensor just before its first write."""
        if not (self.first and self.watch):
            yield
            return
        for path, t, _ in self._seen:
            storage = _storage_key(t)
            if storage is not None and path not in self._clones:
                self._unwritten.setdefault(storage, []).append((path, t))
        if not self._unwritten:
            yield
            return
        with watch_writes(self._before_write):
            yield

    def _before_write(self, t: torch.Tensor) -> None:
        storage = _storage_key(t)
        for path, seen in self._unwritten.pop(storage, []) if storage is not None else []:
            self._clones[path] = seen.detach().clone()

    def after_forward(self) -> None:
        """Learn what the forward wrote (buffers, argument tensors); drop the references to the arguments."""
        self._check_writes()
        if self.first:
            for path, clone in self._clones.items():  # what the recompute must read instead of the written
                i = path[0][1]
                self.copies[i] = _put(self.copies[i], path[1:], clone)
            for i, (m, name, _) in enumerate(self.buffers):  # copied only in case the forward wrote them
                if (id(m), name) not in self.memory.written_buffers:
                    self.buffer_copies.pop(i, None)
        self._seen, self._clones, self._unwritten = [], {}, {}

    def _check_writes(self) -> None:
        # The first call saw each write as it happened (``watching``); later calls watch version counters.
        for path, t, version in self._seen:
            moved = tensor_version(t) != version
            if not self.watch and self.first:  # everything was cloned: compare values
                if not (moved or not _same(t, self._clones[path])):
                    self._clones.pop(path)  # left alone: later calls need not clone it
            elif self.first and moved and path not in self._clones:
                raise RecomputeError(
                    f"block {self.block!r} changed the tensor at {_describe(path)} behind torch's dispatcher (its "
                    "version counter moved, but no op was seen writing it), so its recompute cannot start from "
                    "the state its forward saw. Turn checkpointing off for this block "
                    "(BMTrainModelWrapper(model, checkpoint=False) or the plan's checkpoint flag).")
            if not (path in self._clones if self.first else moved):
                continue
            known = path in self.memory.written_paths
            self.memory.written_paths.add(path)
            if not known and self.memory.calls > 1:
                raise RecomputeError(
                    f"block {self.block!r} wrote in place into a tensor at {_describe(path)} that its earlier "
                    "calls left alone, so its recompute cannot start from the state its forward saw. Turn "
                    "checkpointing off for this block (BMTrainModelWrapper(model, checkpoint=False) or the "
                    "plan's checkpoint flag).")
        for i, (m, name, b) in enumerate(self.buffers):
            # Kernels may write a buffer without bumping its version (batch norm's running statistics), so the
            # first call, which copied every buffer, compares values; later calls watch version counters.
            # ``self.x_min = f(self.x_min)`` (IBert) leaves the old tensor untouched and registers a new one.
            reassigned = m._buffers.get(name) is not b
            if reassigned or tensor_version(b) != self._buffer_versions[i] or (
                    self.first and not _same(b, self.buffer_copies[i])):
                self.memory.written_buffers.add((id(m), name))
                if i not in self.buffer_copies:
                    # Written for the first time in a later call: its value before this forward is gone; the
                    # recompute reads the written value but writes a copy, so it still updates only once.
                    self.buffer_copies[i] = b.detach().clone()

    def leaves(self, leaves: list[Any], hidden: list[torch.Tensor]) -> list[Any]:
        """The forward's non-tensor leaves with the mutable ones replaced by their copies, which hold
        ``hidden`` (fresh leaves) where the hidden inputs were."""
        out = [self.copies.get(i, x) for i, x in enumerate(leaves)]
        for (_, paths), t in zip(self._hidden, hidden, strict=True):
            for path in paths:
                i = path[0][1]
                out[i] = _put(out[i], path[1:], t)
        return out

    @contextmanager
    def buffers_swapped(self) -> Iterator[None]:
        """During the recompute, written buffers are copies: the real ones keep the forward's update."""
        saved = []
        for i, copy_ in self.buffer_copies.items():
            m, name, b = self.buffers[i]
            saved.append((m, name, m._buffers[name]))
            m._buffers[name] = copy_
        try:
            yield
        finally:
            for m, name, b in saved:
                m._buffers[name] = b
