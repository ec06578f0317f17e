"""Reduce-scatter of gradients during backward, and the end-of-backward callback that finishes them.

Every group's full gradient goes through ``reduce``: an async reduce-scatter (rank average, DDP
semantics) into the group's gradient shard, overlapping the next block's backward (a shard offloaded to
host memory receives it on the device and copies it home when it ends). Under HSDP the
reduce-scatter runs within the shard group and the shard is then averaged across the replicas (one
all-reduce of the shard), so every rank holds the world average. When backward
returns, an autograd callback has waited for all of them, agreed across ranks which parameters got a
gradient (one small all-reduce), and set each parameter's ``.grad`` to its view of the gradient shard;
a parameter no rank used keeps ``.grad is None``, as in torch.

A backward that raises midway never runs that callback: autograd drops it unrun with the graph task. The
reducer keeps only a weak reference to it, so the next backward or forward sees it is gone (``aborted``)
and the engine abandons what that backward left (``abandon``).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..base._compat import queue_autograd_callback
from ..base.plan import GRADS_IN_FLIGHT
from .buffer_pool import BufferPool
from .comm import Communicator, Handle
from .flat_buffer import FlatBuffer
from .offload import release_pages
from .sharded_tensor import local_view
from .tp_reduce import ThenScale, ThenSumOverTP

# One reduce-scatter in flight overlaps the next block's whole recompute and backward, which is enough to
# hide it; gloo runs them one at a time anyway, and each one more in flight holds a block of memory.
MAX_IN_FLIGHT = GRADS_IN_FLIGHT


@dataclass
class _Touched:
    buffer: FlatBuffer
    had_grad: list[bool]
    used: list[bool]
    accumulate: bool  # False: the first reduce-scatter of this step may overwrite the shard
    grad_shard: torch.Tensor  # held until the parameters' .grad views hold it


@dataclass
class _Pending:
    handle: Handle
    done: Callable[[], None]  # apply the reduced gradient and give the buffers back
    discard: Callable[[], None]  # only give the buffers back (the backward was aborted)


def _then_average(first: Handle, shard_comm: Communicator, replicas: Communicator, shard: torch.Tensor,
                  label: str) -> Handle:
    """The reduce-scatter ``first`` into ``shard``, then the average of ``shard`` across replicas."""
    if replicas.runs_after(shard_comm):  # one FIFO worker (gloo): post it now, it runs once ``first`` is done
        return _Both(first, replicas.all_reduce(shard, "avg", async_op=True, label=f"{label} replicas"))
    return _ThenAverage(first, replicas, shard, label)


class _Both(Handle):
    """Two ops posted in order; done when both are."""

    def __init__(self, first: Handle, second: Handle | None) -> None:
        self._first, self._second = first, second

    def wait(self) -> None:
        """Wait for both, in order."""
        self._first.wait()
        if self._second is not None:
            self._second.wait()


class _ThenAverage(Handle):
    """A reduce-scatter within the shard group, then the average of its result across replicas.

    The all-reduce starts when the reduce-scatter is waited for: backends that run each group's ops on
    their own stream could otherwise read the shard before the reduce-scatter wrote it.
    """

    def __init__(self, first: Handle, replicas: Communicator, shard: torch.Tensor, label: str) -> None:
        self._first, self._replicas, self._shard, self._label = first, replicas, shard, label

    def wait(self) -> None:
        """Finish the reduce-scatter, then average the shard across replicas."""
        self._first.wait()
        self._replicas.all_reduce(self._shard, "avg", label=f"{self._label} replicas")


def _then_release(done: Callable[[], None], grad_shard: torch.Tensor) -> Callable[[], None]:
    """``done``, then (offloaded) the gradient shard's pages leave memory: its reduce-scatter has ended."""
    def finish() -> None:
        done()
        release_pages(grad_shard)
    return finish


class _EndOfBackward:
    """The queued end-of-backward callback; autograd drops it unrun when the backward raises."""

    def __init__(self, reducer: GradReducer) -> None:
        self.reducer = reducer

    def __call__(self) -> None:
        self.reducer.finalize()


@dataclass
class GradReducer:
    """Owns outstanding reduce-scatters of one backward pass."""

    comm: Communicator
    pool: BufferPool
    device: torch.device = torch.device("cpu")  # where the communicator takes tensors (NCCL: the GPU)
    on_finalize: list[Callable[[], None]] = field(default_factory=list)
    before_finalize: list[Callable[[], None]] = field(default_factory=list)  # may still call ``reduce``
    # Where the used-parameter mask is agreed: the ranks that use the same groups (the job; a pipeline stage)
    mask_comm: Communicator | None = None
    # Under pipeline parallelism, every buffer placed on one stage, its own and other stages' ghosts, in the
    # order every rank built them: which of their parameters got a gradient is agreed over the pipe group.
    staged: list[weakref.ref[FlatBuffer]] = field(default_factory=list)
    _pending: deque = field(default_factory=deque)
    _touched: dict[int, _Touched] = field(default_factory=dict)
    callback_queued: bool = False
    _queued: weakref.ref[_EndOfBackward] | None = None  # alive while its backward's graph task is

    def ensure_callback(self) -> None:
        """Queue the end-of-backward callback once per backward (call from inside backward)."""
        if not self.callback_queued:
            callback = _EndOfBackward(self)
            queue_autograd_callback(callback)
            self._queued = weakref.ref(callback)
            self.callback_queued = True

    @property
    def aborted(self) -> bool:
        """True when the backward that queued the callback ended without running it (it raised)."""
        return self.callback_queued and (self._queued is None or self._queued() is None)

    def abandon(self) -> None:
        """Drop an aborted backward's reductions: finish those in flight (every rank posted them) and give
        their buffers back without applying them. A parameter whose ``.grad`` was None keeps None; one that
        held a gradient (accumulation) may already hold part of the failed step's, as in torch."""
        try:
            while self._pending:
                pending = self._pending.popleft()
                pending.handle.wait()
                pending.discard()
        finally:
            self._pending.clear()  # only left after a failed wait: the process group is unusable then
            self._touched.clear()
            self.callback_queued = False
            self._queued = None

    def reduce(self, buffer: FlatBuffer, full_grad: torch.Tensor, used: list[bool],
               release: Callable[[], None]) -> None:
        """Start the rank-average reduce-scatter of ``full_grad``; ``release`` gives it back when done."""
        self.ensure_callback()
        touched = self._touch(buffer)
        touched.used = [a or b for a, b in zip(touched.used, used, strict=True)]
        grad_shard = touched.grad_shard
        # Offloaded to host memory: the reduce-scatter runs on the device, its result is copied home when done.
        staged = buffer.home is not None and buffer.home.store.staged
        if not touched.accumulate and full_grad.dtype == grad_shard.dtype and not staged:
            # A fresh shard no .grad views yet: an aborted backward's write into it is never seen.
            out = grad_shard
            done: Callable[[], None] = release
            discard: Callable[[], None] = release
        else:
            out = self.pool.acquire(buffer.shard_numel, full_grad.dtype, full_grad.device)
            accumulate = touched.accumulate

            def done() -> None:
                if accumulate:
                    grad_shard.add_(out.to(grad_shard.device))
                else:
                    grad_shard.copy_(out)
                discard()

            def discard() -> None:
                self.pool.release(out)
                release()
        touched.accumulate = True  # a second call of the same block in this step adds to the first
        handle = buffer.comm.reduce_scatter_into(out, full_grad, "avg", async_op=True, label=buffer.group_name)
        if buffer.replicas is not None:
            handle = _then_average(handle, buffer.comm, buffer.replicas, out, buffer.group_name)
        if buffer.tp_sum is not None:
            handle = ThenSumOverTP(handle, *buffer.tp_sum, out, buffer.group_name)
        if buffer.tp_scale is not None:
            handle = ThenScale(handle, *buffer.tp_scale, out)
        if buffer.grad_scale is not None:
            handle = ThenScale(handle, buffer.grad_scale, [(0, out.numel())], out)
        self._pending.append(_Pending(handle, _then_release(done, grad_shard), discard))

    @property
    def reduced_any(self) -> bool:
        """True when this backward has started a reduce-scatter (it synchronises gradients)."""
        return bool(self._touched)

    def make_room(self) -> None:
        """Before taking another full-gradient buffer: at most ``MAX_IN_FLIGHT`` exist at once."""
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._complete_oldest()

    def _touch(self, buffer: FlatBuffer) -> _Touched:
        touched = self._touched.get(id(buffer))
        if touched is None:
            had = [p.grad is not None for p in buffer.params]
            # Without gradients to keep, the first reduce-scatter overwrites a fresh shard (as torch gives
            # fresh .grad tensors after zero_grad(set_to_none=True)).
            accumulate = any(had)
            shard = buffer.ensure_grad_shard() if accumulate else buffer.new_grad_shard(zeroed=False)
            touched = _Touched(buffer, had, [False] * len(had), accumulate=accumulate, grad_shard=shard)
            if touched.accumulate:
                adopt_existing_grads(buffer)
            self._touched[id(buffer)] = touched
        return touched

    def _complete_oldest(self) -> None:
        pending = self._pending.popleft()
        pending.handle.wait()
        pending.done()

    def wait_all(self) -> None:
        """Finish every outstanding reduce-scatter."""
        while self._pending:
            self._complete_oldest()

    def finalize(self) -> None:
        """End of backward: finish reductions, agree on used parameters, set ``.grad`` views."""
        try:
            for fn in self.before_finalize:
                fn()
            self.wait_all()
            touched = list(self._touched.values())
            if touched:
                # float32: USED_MASK_BYTES per parameter, as the plan estimates
                mask = torch.tensor([u for t in touched for u in t.used], dtype=torch.float32, device=self.device)
                comm = self.mask_comm or self.comm
                if comm.world_size > 1:
                    comm.all_reduce(mask, "max", label="used-parameter mask")
                used = (mask > 0).tolist()
                pos = 0
                for t in touched:
                    for i, p in enumerate(t.buffer.params):
                        if used[pos] or t.had_grad[i]:
                            view = t.buffer.grad_view(i)
                            if p.grad is None or not _is_view_of(p.grad, view):
                                p.grad = t.buffer.grad_tensor(i)
                        pos += 1
            self._agree_across_stages()
        finally:
            self._touched.clear()
            self.callback_queued = False
            self._queued = None
            for fn in self.on_finalize:
                fn()


    @contextmanager
    def stages_agree_after(self) -> Iterator[None]:
        """Backwards inside leave the stages' agreement (``_agree_across_stages``) to the end of the block, where
        it runs once: a pipeline schedule runs each stage's backwards at its own time, and a collective over
        the pipe group inside one would wait for a stage that waits for this one's gradients."""
        staged, self.staged = self.staged, []
        try:
            yield
        finally:
            self.staged = staged + self.staged
        self._agree_across_stages()

    def _agree_across_stages(self) -> None:
        """Under pipeline parallelism, the stages' share of the end of a backward: a buffer two stages hold
        (a tied embedding and head) gets the sum of both stages' gradients (one exchange between them), and
        a parameter held by one stage gets a ``.grad`` on every stage when it got one there (a ghost's over
        its empty range), so every rank hands torch's ``clip_grad_norm_`` and optimizers the same list of
        parameters (one all-reduce over the pipe group)."""
        buffers = [b for b in (ref() for ref in self.staged) if b is not None]
        self.staged = [weakref.ref(b) for b in buffers]
        if not buffers:
            return
        # Every rank holds every stage's buffers (its own, or ghosts): in one order, the same everywhere.
        buffers.sort(key=lambda b: (b.group_name, b.spec.slots[0].fqn))
        pp = buffers[0].stage.pp
        summed = [_sum_with_partners(b) for b in buffers]  # kept alive until the .grad views hold them
        mask = torch.tensor([float(p.grad is not None) for b in buffers for p in b.params], dtype=torch.float32,
                            device=self.device)
        pp.all_reduce(mask, "max", label="used-parameter mask over the stages")
        flags = iter((mask > 0).tolist())
        for b in buffers:
            for i, p in enumerate(b.params):
                if next(flags) and p.grad is None:
                    p.grad = b.grad_tensor(i)
        del summed


def _sum_with_partners(buffer: FlatBuffer) -> torch.Tensor | None:
    """The sum of this buffer's gradient shard and that of the other stages holding it (point to point;
    the lower stage sends first). None for a buffer only one stage holds."""
    stage = buffer.stage
    assert stage is not None
    if not stage.shared_with:
        return None
    grad = buffer.ensure_grad_shard()
    theirs = torch.empty_like(grad)
    for peer in stage.shared_with:
        pair = sorted((stage.pp.rank, peer))
        label = f"{buffer.group_name} gradient shared by stages {pair[0]} and {pair[1]}"
        if stage.pp.rank < peer:
            stage.pp.send(grad, peer, label=label)
            stage.pp.recv(theirs, peer, label=label)
        else:
            stage.pp.recv(theirs, peer, label=label)
            stage.pp.send(grad, peer, label=label)
        grad.add_(theirs)
    return grad


@torch.no_grad()
def adopt_existing_grads(buffer: FlatBuffer) -> None:
    """Before accumulating: make the gradient shard hold exactly the parameters' current ``.grad``."""
    for i, p in enumerate(buffer.params):
        view = buffer.grad_view(i)
        if p.grad is None:
            view.zero_()
        elif not _is_view_of(p.grad, view):
            view.copy_(local_view(p.grad))
            p.grad = buffer.grad_tensor(i)


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    grad = local_view(grad)
    return grad.numel() == view.numel() and (view.numel() == 0 or grad.data_ptr() == view.data_ptr())
