"""CPU backend: gloo point-to-point transfers straight into the destination, driven by one worker thread.

Why point-to-point: gloo's own all-gather gathers into scratch and copies out, and its reduce-scatter
runs a full all-reduce (2x the bytes) on a clone; ``isend``/``irecv`` into the destination moves each
byte once (docs/design.md, CPU facts). Why one worker thread: ops must reach gloo in the same order on every
rank, async ops (a ring reduce-scatter is N-1 dependent steps) need something to drive them, and a
single FIFO thread gives both while the main thread computes.

Every op first checks that all ranks are at the same collective: each rank sends every peer a 128-byte
description of its op (``purpose.describe_op``: what defines it, and text for the message) and compares
the defining part with what it receives. A block skipped or repeated on one rank then raises
``CollectiveMismatchError`` naming both sides on every rank at its first divergent collective, instead of
exchanging the wrong block's data or hanging until the timeout. The check runs on the worker thread, inside the op the caller already waits for: no extra
round trip on the main thread (benchmarks/comm.py measures what it costs).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError, CommError
from .base import Communicator, Handle, split_offsets
from .purpose import RECORD_BYTES, OpDescription, describe_op, mismatch_message
from .subgroups import GroupRef, process_group_subgroup

_TAG_ALL_GATHER = 11
_TAG_REDUCE_SCATTER = 12
_TAG_ORDER = 13
_TAG_P2P = 14
_TAG_ALL_TO_ALL = 15
_TAG_SPREAD = 1 << 20  # data tags: op tag + a hash of what defines the op, below this

# How gloo words a peer that exited, crashed or timed out and closed its sockets (torch 2.13).
_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "application crash", "remote worker")

_Work = tuple[Any, int | None]  # a torch Work and the peer rank it transfers with (None: a collective)

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _Future(Handle):
    """Completion of one op run by the worker thread."""

    def __init__(self, comm: GlooCommunicator, what: str) -> None:
        self._comm = comm
        self._what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        """Block until the worker finished this op, or raise ``CommTimeoutError`` after the timeout."""
        if not self._done.wait(self._comm.timeout.total_seconds()):
            raise self._comm.timeout_error(self._what)
        if self._error is not None:
            if isinstance(self._error, CommError):
                raise self._error
            self._comm.broken = f"{self._what} failed"
            raise CommError(f"{self._what} failed on the {self._comm.describe()}: {self._error}. "
                            "The process group is unusable after this; restart the job.") from self._error


class GlooCommunicator(Communicator):
    """torch.distributed/gloo on CPU tensors, through point-to-point sends into the destination."""

    backend_name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, timeout: timedelta,
                 check_order: bool = True, global_ranks: Sequence[int] | None = None,
                 worker: GlooCommunicator | None = None) -> None:
        super().__init__(rank, world_size, timeout)
        self._group = GroupRef(group)  # weak: the group dies with destroy_process_group
        # torch's point-to-point calls and broadcast name peers by their rank in the default group
        self._global = tuple(global_ranks) if global_ranks is not None else tuple(range(world_size))
        self.check_order = check_order  # BMT_WRAP_CHECK_COLLECTIVES=0 turns it off
        self._sequence = 0  # collectives run so far (worker thread only)
        # Sub-groups share their parent's worker: every op of the process then runs in the order it was
        # posted, which all ranks share, so no two groups can wait on each other, and an op posted after
        # another one's (the replicas' average after its reduce-scatter) runs after it.
        self._owner = worker._owner if worker is not None else self
        if worker is not None:
            self._queue, self._thread = worker._queue, worker._thread
            return
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], _Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bmt_wrap-gloo", daemon=True)
        self._thread.start()

    def runs_after(self, other: Communicator) -> bool:
        """True when ``other`` is a gloo communicator on this worker: an op posted here after one posted
        there starts once that one finished."""
        return isinstance(other, GlooCommunicator) and other._owner is self._owner

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the worker thread once queued ops are done (before the process group is destroyed);
        False if it is still inside a collective after ``timeout`` seconds. A sub-group leaves the shared
        worker to its owner."""
        if self._owner is not self:
            return True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        return process_group_subgroup(self, self._global, ranks, group, lambda g, rank, size, glob: GlooCommunicator(
            g, rank, size, self.timeout, self.check_order, global_ranks=glob, worker=self))

    def global_rank(self, rank: int) -> int:
        """The job's rank of this group's ``rank``."""
        return self._global[rank]

    def describe(self) -> str:
        """The group, with its global ranks when it is a sub-group."""
        text = super().describe()
        return text if self._global == tuple(range(self.world_size)) else f"{text} (global ranks {list(self._global)})"

    # ---- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            del item
            error = self._run_one(fn, fut)
            # The op's closure holds its tensors. It goes before the waiter wakes, so a finished op keeps
            # none of them: kept until the next op arrived, the last op's buffer (a group's full flat at
            # wrapping, a gradient at a step's end) outlived it; dropped after the wake-up, a caller that
            # freed its own references could still see them alive for a moment.
            del fn
            fut._set(error)

    @staticmethod
    def _run_one(fn: Callable[[], None], fut: _Future) -> BaseException | None:
        if fut._comm.broken is not None:  # the op's own group: sub-groups share this worker
            return fut._comm.unusable_error(fut._what)
        try:
            # Grad mode is per thread, and this one's is on: the caller's views (made under no_grad in an
            # autograd Function's forward) may only be written here under no_grad too.
            with torch.no_grad():
                fn()
        except BaseException as exc:  # reported to the waiting thread, which raises it
            return exc
        return None

    def _submit(self, op: OpDescription, fn: Callable[[Callable[[], None]], None],
                peers: tuple[int, ...] | None = None) -> _Future:
        """Queue ``fn(verify)``; ``fn`` posts its first transfers, calls ``verify()``, then waits on them.
        ``peers``: the ranks taking part (a point-to-point pair), default every rank of the group."""
        fut = _Future(self, op.text)

        def checked() -> None:
            self._sequence += 1
            if not self.check_order:
                fn(lambda: None)
                return
            # The descriptions travel beside the op's first transfers (no extra round trip); they are
            # compared before waiting on the data, which a divergent peer may never send.
            posted = self._post_order(op, peers)
            fn(lambda: self._verify(posted, op))

        self._queue.put((checked, fut))
        return fut

    def _post_order(self, op: OpDescription, peers: tuple[int, ...] | None = None
                    ) -> tuple[dict[int, torch.Tensor], list[_Work]]:
        mine = op.encode()
        peers = peers if peers is not None else tuple(range(self.world_size))
        theirs = {p: torch.empty(RECORD_BYTES, dtype=torch.uint8) for p in peers if p != self.rank}
        works = []
        for peer, buf in theirs.items():
            works.append((dist.isend(mine, self._global[peer], group=self._group(), tag=_TAG_ORDER), peer))
            works.append((dist.irecv(buf, self._global[peer], group=self._group(), tag=_TAG_ORDER), peer))
        return theirs, works

    def _verify(self, posted: tuple[dict[int, torch.Tensor], list[_Work]], op: OpDescription) -> None:
        """Raise ``CollectiveMismatchError`` on every rank unless all ranks are running ``op`` now."""
        theirs, works = posted
        self._wait_all(works, f"the order check before {op.text}")
        sides = {p: OpDescription.decode(buf) for p, buf in theirs.items()}
        if all(side.key == op.key for side in sides.values()):
            return
        sides[self.rank] = op
        self.mismatch = (f"{mismatch_message(self._sequence, sides)} The process group is unusable after this; "
                         "restart the job.")
        self.broken = f"collective #{self._sequence} differed across ranks"
        raise CollectiveMismatchError(self.mismatch)

    def _wait_all(self, works: list[_Work], what: str) -> None:
        """Wait on each (work, peer); peer is the one rank a transfer is with (None: a collective), named
        when its connection is lost."""
        for work, peer in works:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                text = str(exc).lower()
                if "timed out" in text or "timeout" in text:
                    raise self.timeout_error(what) from exc
                if any(marker in text for marker in _PEER_GONE):
                    raise self.peer_lost_error(what, str(exc), peer) from exc
                raise

    # ---- ops --------------------------------------------------------------------------------------
    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        desc = describe_op("all_gather_into", shard, label)
        n, r, size = self.world_size, self.rank, shard.numel()
        tag = _data_tag(_TAG_ALL_GATHER, desc)

        def run(verify: Callable[[], None]) -> None:
            works = []
            for peer in range(n):
                if peer != r:
                    works.append((dist.isend(shard, self._global[peer], group=self._group(), tag=tag), peer))
                    works.append((dist.irecv(out[peer * size:(peer + 1) * size], self._global[peer],
                                             group=self._group(), tag=tag), peer))
            out[r * size:(r + 1) * size].copy_(shard)
            verify()
            self._wait_all(works, desc.text)

        return self._submit(desc, run)

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        desc = describe_op("reduce_scatter_into", out, label, op)
        n, r, size = self.world_size, self.rank, out.numel()
        tag = _data_tag(_TAG_REDUCE_SCATTER, desc)

        def piece(i: int) -> torch.Tensor:
            return full[(i % n) * size:((i % n) + 1) * size]

        def run(verify: Callable[[], None]) -> None:
            # Ring: at step s rank r sends its running sum of chunk r-s-1 to r+1 and receives chunk r-s-2
            # from r-1, adding its own piece; after n-1 steps it holds the full sum of chunk r. Buffers
            # alternate so the last step receives straight into `out` (one scratch piece, no copy).
            nxt, prv = (r + 1) % n, (r - 1) % n
            scratch = torch.empty_like(out) if n > 2 else None
            send = piece(r - 1)
            for step in range(n - 1):
                recv = out if (n - 2 - step) % 2 == 0 else scratch
                works = [(dist.isend(send, self._global[nxt], group=self._group(), tag=tag), nxt),
                         (dist.irecv(recv, self._global[prv], group=self._group(), tag=tag), prv)]
                if step == 0:
                    verify()
                self._wait_all(works, desc.text)
                recv.add_(piece(r - step - 2))
                send = recv
            if op == "avg":
                out.div_(n)

        return self._submit(desc, run)

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        desc = describe_op("all_reduce", tensor, label, op)

        def run(verify: Callable[[], None]) -> None:
            work = dist.all_reduce(tensor, _TORCH_OPS.get(op, dist.ReduceOp.SUM), group=self._group(),
                                   async_op=True)
            verify()
            self._wait_all([(work, None)], desc.text)
            if op == "avg":
                tensor.div_(self.world_size)

        return self._submit(desc, run)

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        desc = describe_op("broadcast", tensor, label, f"from rank {src}")

        def run(verify: Callable[[], None]) -> None:
            work = dist.broadcast(tensor, self._global[src], group=self._group(), async_op=True)
            verify()
            self._wait_all([(work, None)], desc.text)

        return self._submit(desc, run)

    def _barrier(self, label: str) -> Handle:
        flag = torch.zeros(1)
        desc = describe_op("barrier", None, label)

        def run(verify: Callable[[], None]) -> None:
            work = dist.all_reduce(flag, group=self._group(), async_op=True)
            verify()
            self._wait_all([(work, None)], desc.text)

        return self._submit(desc, run)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        # Sizes differ by rank, so the op is defined by its label and dtype; pieces go straight into ``out``.
        desc = describe_op("all_to_all", None, f"{label} ({inp.dtype})")
        tag = _data_tag(_TAG_ALL_TO_ALL, desc)
        r, starts_in, starts_out = self.rank, split_offsets(in_splits), split_offsets(out_splits)

        def run(verify: Callable[[], None]) -> None:
            works = []
            for peer in range(self.world_size):
                if peer == r:
                    continue
                if in_splits[peer]:  # an empty piece is not sent: the peer expects none (its out_splits)
                    piece = inp[starts_in[peer]:starts_in[peer] + in_splits[peer]]
                    works.append((dist.isend(piece, self._global[peer], group=self._group(), tag=tag), peer))
                if out_splits[peer]:
                    works.append((dist.irecv(out[starts_out[peer]:starts_out[peer] + out_splits[peer]],
                                             self._global[peer], group=self._group(), tag=tag), peer))
            out[starts_out[r]:starts_out[r] + out_splits[r]].copy_(inp[starts_in[r]:starts_in[r] + in_splits[r]])
            verify()
            self._wait_all(works, desc.text)

        return self._submit(desc, run)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        return self._point_to_point(tensor, self.rank, dst, tag, label)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        return self._point_to_point(tensor, src, self.rank, tag, label)

    def _point_to_point(self, tensor: torch.Tensor, src: int, dst: int, tag: int, label: str) -> Handle:
        # Both ends describe the transfer alike (pair, tag, size, label), so the order check compares the
        # sender's op with the receiver's; the data's tag carries the caller's tag and that description.
        desc = describe_op("send/recv", tensor, label, f"rank {src} -> rank {dst}, tag {tag}")
        data_tag = _data_tag(_TAG_P2P, desc)
        peer = dst if src == self.rank else src

        def run(verify: Callable[[], None]) -> None:
            if src == self.rank:
                work = dist.isend(tensor, self._global[dst], group=self._group(), tag=data_tag)
            else:
                work = dist.irecv(tensor, self._global[src], group=self._group(), tag=data_tag)
            verify()
            self._wait_all([(work, peer)], desc.text)

        return self._submit(desc, run, peers=(self.rank, peer))


def _data_tag(op_tag: int, op: OpDescription) -> int:
    """The tag of an op's data transfers, equal on ranks running the same op. Ranks at different ops (a
    block skipped on one) then never match each other's data: gloo aborts the process on a size mismatch
    (``op.preamble.length <= op.nbytes``) before the order check could raise ``CollectiveMismatchError``."""
    return op_tag * _TAG_SPREAD + op.tag % _TAG_SPREAD
