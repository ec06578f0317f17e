"""Gradients kept on this rank, unreduced, while a model accumulates under ``no_sync`` (docs/api.md).

Under ``no_sync`` a buffer's full flat gradient, the tensor a synchronised backward reduce-scatters, is
added into a full-size accumulator in the gradient (reduce) dtype instead; the first backward outside it
adds the accumulator to its own full gradient and reduces the sum once. This is what FSDP's ``no_sync``
and FSDP2's ``set_requires_gradient_sync(False)`` cost: every trainable buffer's unsharded gradient, held
for the whole window. The first micro-batch keeps the pooled full-gradient buffer itself (no copy); the
accumulator is freed, never pooled, when reduced, so the pool does not grow to the model's size.

The window's sums live here, not in ``.grad``; so that ``zero_grad()`` inside the window still discards
them as torch's would, each parameter that got a gradient is given a ``.grad`` viewing its buffer's
gradient shard (zeros when it had none), and before the accumulator is used again a ``.grad`` set to
None or replaced drops that parameter's part, and one changed in place raises (``reconcile``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..base._compat import tensor_version
from ..errors import GradSyncError
from .flat_buffer import FlatBuffer
from .grad_reduce import adopt_existing_grads
from .group import ShardGroup
from .offload import release_pages


@dataclass(eq=False)
class LocalGrad:
    """One flat buffer's accumulated, unreduced gradient."""

    buffer: FlatBuffer
    full: torch.Tensor  # full_numel elements in the buffer's gradient dtype, laid out as the gathered buffer
    used: list[bool]  # slots that got a gradient on this rank during the window
    # Per slot, the ``.grad`` we left at the last backward's end and its version counter then: a different
    # object, or a bumped version, was the user's doing. (The wrapper's own counter: in-place ops on a
    # sharded tensor run on its local range below autograd, which bumps no counter of the shard.)
    marked: list[weakref.ref[torch.Tensor] | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def reconcile(self) -> None:
        """Drop the part of every parameter whose ``.grad`` the user cleared since the last backward."""
        cleared: list[int] = []
        for i, (p, ref) in enumerate(zip(self.buffer.params, self.marked, strict=False)):
            if ref is None:
                continue
            if p.grad is None or p.grad is not ref():
                cleared.append(i)  # set to None (zero_grad) or replaced
            elif tensor_version(p.grad) != self.versions[i]:
                # Changed in place: the same on every rank (values are not, each holds its own range), so
                # every rank raises alike. Zeroing is such a change too: its intent cannot be told apart here.
                raise GradSyncError(
                    f"the .grad of {self.buffer.spec.slots[i].fqn!r} was changed in place inside model.no_sync() "
                    "(zero_grad(set_to_none=False) does this too): the window's gradients are held unreduced "
                    "outside .grad, so an in-place change cannot apply to them. Change gradients after the "
                    "synchronising backward (the first one outside no_sync); to discard the window, call "
                    "zero_grad() with set_to_none=True (the default) or model.zero_grad().")
        for i in cleared:
            slot = self.buffer.spec.slots[i]
            self.full[slot.offset:slot.offset + slot.numel].zero_()
            self.used[i] = False
            self.marked[i] = None

    def mark(self) -> None:
        """Point ``.grad`` of every parameter with a gradient here at the gradient shard (zeros if new)."""
        buf = self.buffer
        if not any(self.used) and not any(p.grad is not None for p in buf.params):
            return
        grad_shard = buf.ensure_grad_shard()
        adopt_existing_grads(buf)
        self.marked, self.versions = [], []
        for i, p in enumerate(buf.params):
            if p.grad is None and self.used[i]:
                p.grad = buf.grad_tensor(i)
            self.marked.append(weakref.ref(p.grad) if p.grad is not None else None)
            self.versions.append(tensor_version(p.grad) if p.grad is not None else 0)
        release_pages(grad_shard, self.full)


class LocalGrads:
    """Which groups accumulate without communication now, and what they accumulated (one per engine)."""

    def __init__(self) -> None:
        self._paused: weakref.WeakKeyDictionary[ShardGroup, int] = weakref.WeakKeyDictionary()
        self._pending: dict[int, LocalGrad] = {}  # by id(buffer), in the order first kept: alike on every rank

    def pause(self, groups: Iterable[ShardGroup]) -> None:
        """Gradients of ``groups`` stay local until ``resume`` (nests)."""
        for g in groups:
            self._paused[g] = self._paused.get(g, 0) + 1

    def resume(self, groups: Iterable[ShardGroup]) -> None:
        """Undo one ``pause`` of ``groups``."""
        for g in groups:
            depth = self._paused.get(g, 0) - 1
            if depth > 0:
                self._paused[g] = depth
            else:
                self._paused.pop(g, None)

    def syncing(self, group: ShardGroup) -> bool:
        """True unless ``group`` is inside a ``no_sync`` window."""
        return group not in self._paused

    def keep(self, buffer: FlatBuffer, full: torch.Tensor, used: list[bool], release: Callable[[], None]) -> None:
        """Add ``full`` (this backward's flat gradient) to the buffer's accumulator instead of reducing it."""
        local = self._pending.get(id(buffer))
        if local is None:
            if buffer.home is not None:  # offloaded: the window's sum accumulates in its store (file, host)
                acc = buffer.home.accumulator(full.numel(), full.dtype).copy_(full)
                release()
                release_pages(acc)
                full = acc
            self._pending[id(buffer)] = LocalGrad(buffer, full, list(used))  # keeps the buffer: no release
            return
        local.reconcile()
        local.full.add_(full.to(local.full.device))
        release_pages(local.full)
        local.used = [a or b for a, b in zip(local.used, used, strict=True)]
        release()

    def take(self, buffer: FlatBuffer) -> LocalGrad | None:
        """The buffer's accumulator, removed, for a synchronising backward to add and reduce."""
        local = self._pending.pop(id(buffer), None)
        if local is not None:
            local.reconcile()
        return local

    def take_syncing(self) -> list[LocalGrad]:
        """Accumulators of groups no longer in a window, removed: a synchronising backward that did not
        reach them reduces them at its end."""
        out = [loc for loc in self._pending.values() if self.syncing(loc.buffer.group)]  # type: ignore[arg-type]
        for loc in out:
            del self._pending[id(loc.buffer)]
            loc.reconcile()
        return out

    def mark_all(self) -> None:
        """End of a backward: let ``.grad`` of what the window holds show the user's later clears."""
        for local in self._pending.values():
            local.reconcile()
            local.mark()

    def pending(self, buffers: Iterable[FlatBuffer] | None = None) -> list[LocalGrad]:
        """Accumulators waiting for a synchronising backward (of ``buffers`` only, when given)."""
        if buffers is None:
            return list(self._pending.values())
        ids = {id(b) for b in buffers}
        return [loc for key, loc in self._pending.items() if key in ids]

    def discard(self, buffers: Iterable[FlatBuffer]) -> None:
        """Forget the accumulators of ``buffers`` (``model.zero_grad()`` on every rank)."""
        for b in buffers:
            self._pending.pop(id(b), None)
