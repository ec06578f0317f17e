"""GPU backend: NCCL through ``cupy.cuda.nccl`` on a dedicated stream, ordered against torch's stream.

Waits are stream-ordered: ``Handle.wait()`` makes torch's current stream wait on the collective's event
and returns at once, so the host runs ahead and queues the next blocks' work while NCCL runs (FSDP2's
model). Timeouts still hold: a watchdog thread (watchdog.py) aborts the NCCL communicator when a
collective passes its deadline or NCCL reports an asynchronous error, which frees the stuck stream,
and the next call on this rank raises ``CommTimeoutError``/``CommError`` naming the collective.

CuPy is imported lazily so this module imports cleanly on machines without a GPU or without CuPy.
The NCCL unique id travels through the torch.distributed store of the default (gloo) group.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CommError, InitError
from .base import Communicator, Handle, split_offsets
from .single import SingleProcessCommunicator
from .watchdog import CompletionWatchdog

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable since NCCL 2.10; bf16 and avg need >= 2.10).
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
                torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.bool: 1}
_NCCL_OPS = {"sum": 0, "max": 2, "min": 3, "avg": 4}
_UID_KEY = "bmt_wrap/cupy_nccl_unique_id"


def cupy_available() -> bool:
    """True when CuPy with NCCL support imports and a CUDA device is visible."""
    if not torch.cuda.is_available():
        return False
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # ImportError, or CuPy built without NCCL / mismatched CUDA
        return False
    return True


class CupyNcclCommunicator(Communicator):
    """NCCL collectives issued through CuPy on their own stream."""

    backend_name = "cupy-nccl"

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                 global_ranks: tuple[int, ...] | None = None) -> None:
        super().__init__(rank, world_size, timeout)
        self._store = store
        self._global = global_ranks if global_ranks is not None else tuple(range(world_size))
        # Each communicator's id has its own key: a sub-group's first rank publishes it for its members.
        key = _UID_KEY if global_ranks is None else f"{_UID_KEY}/{'-'.join(map(str, global_ranks))}"
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as exc:
            raise InitError("backend='cupy' needs CuPy with NCCL: pip install 'bmt-wrap[gpu]' "
                            f"(cupy-cuda13x), or use backend='nccl' ({exc})") from exc
        self._cupy, self._nccl = cupy, nccl
        self.device = torch.device("cuda", torch.cuda.current_device())
        if rank == 0:
            uid = nccl.get_unique_id()
            store.set(key, bytes(b % 256 for b in uid))
        raw = store.get(key)
        uid = tuple(b if b < 128 else b - 256 for b in raw)  # NCCL's id is a char[128]
        with cupy.cuda.Device(torch.cuda.current_device()):
            self._comm = nccl.NcclCommunicator(world_size, uid, rank)
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._torch_stream = torch.cuda.ExternalStream(self._stream.ptr)
        self._failure: CommError | None = None
        self._watchdog = CompletionWatchdog(self._fail, probe=self._comm.check_async_error)

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        # NCCL needs no torch process group: its own communicator over these ranks, id through the store.
        if len(ranks) == 1:
            return SingleProcessCommunicator(self.timeout)
        return CupyNcclCommunicator(self._store, ranks.index(self.rank), len(ranks), self.timeout,
                                    global_ranks=tuple(self._global[r] for r in ranks))

    def _fail(self, what: str, why: str) -> None:
        """Watchdog thread: ``what`` timed out or NCCL failed; abort so no stream waits forever."""
        if why == "timeout":
            self._failure = self.timeout_error(what)
        else:
            self.broken = what
            self._failure = CommError(f"{what} failed in NCCL on the {self.describe()} ({why}). The process "
                                      "group is unusable after this; restart the job.")
        try:
            self._comm.abort()
        except Exception:  # already torn down: nothing left to release
            pass

    def raise_if_failed(self) -> None:
        """Raise the watchdog's error on the calling thread, if it recorded one."""
        if self._failure is not None:
            raise self._failure

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the watchdog (at shutdown, after the last collective)."""
        self._watchdog.close(timeout)
        return True

    def _launch(self, what: str, tensors: list[torch.Tensor], call: Any) -> Handle:
        self.raise_if_failed()
        # The comm stream waits for work already queued on torch's stream (the buffers' producers).
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        self._torch_stream.wait_event(ready)
        try:
            call(self._stream.ptr)
        except self._nccl.NcclError as exc:
            self.broken = what
            raise CommError(f"{what} failed in NCCL on the {self.describe()}: {exc}") from exc
        for t in tensors:  # keep the caching allocator from reusing these before the op finished
            t.record_stream(self._torch_stream)
        done = torch.cuda.Event()
        done.record(self._torch_stream)
        self._watchdog.watch(done.query, time.monotonic() + self.timeout.total_seconds(), what)
        return _TorchEventHandle(self, done, what)

    def _dtype(self, t: torch.Tensor) -> int:
        if t.dtype not in _NCCL_DTYPES:
            raise CommError(f"NCCL cannot communicate {t.dtype}")
        return _NCCL_DTYPES[t.dtype]

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        return self._launch(f"all_gather_into {label}", [out, shard], lambda s: self._comm.allGather(
            shard.data_ptr(), out.data_ptr(), shard.numel(), self._dtype(shard), s))

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        return self._launch(f"reduce_scatter_into {label}", [out, full], lambda s: self._comm.reduceScatter(
            full.data_ptr(), out.data_ptr(), out.numel(), self._dtype(out), _NCCL_OPS[op], s))

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        return self._launch(f"all_reduce {label}", [tensor], lambda s: self._comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), _NCCL_OPS[op], s))

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        return self._launch(f"broadcast {label}", [tensor], lambda s: self._comm.broadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s))

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        starts_in, starts_out, size = split_offsets(in_splits), split_offsets(out_splits), inp.element_size()

        def call(s: int) -> None:
            # One NCCL group of paired sends and receives: NCCL runs them together, none waits on another.
            self._nccl.groupStart()
            for peer in range(self.world_size):
                if in_splits[peer]:
                    self._comm.send(inp.data_ptr() + starts_in[peer] * size, in_splits[peer], self._dtype(inp),
                                    peer, s)
                if out_splits[peer]:
                    self._comm.recv(out.data_ptr() + starts_out[peer] * size, out_splits[peer], self._dtype(out),
                                    peer, s)
            self._nccl.groupEnd()

        return self._launch(f"all_to_all {label}", [out, inp], call)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        # NCCL matches point-to-point calls between two ranks in posting order; it has no tags.
        return self._launch(f"send to rank {dst} {label}", [tensor], lambda s: self._comm.send(
            tensor.data_ptr(), tensor.numel(), self._dtype(tensor), dst, s))

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        return self._launch(f"recv from rank {src} {label}", [tensor], lambda s: self._comm.recv(
            tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s))

    def _barrier(self, label: str) -> Handle:
        flag = torch.zeros(1, device="cuda")
        return self._all_reduce(flag, "sum", f"barrier {label}")


class _TorchEventHandle(Handle):
    """Completion of a CuPy-stream op, as a torch CUDA event."""

    def __init__(self, comm: CupyNcclCommunicator, event: torch.cuda.Event, what: str) -> None:
        self._comm, self._event, self._what = comm, event, what

    def wait(self) -> None:
        """Order torch's current stream after the op without blocking the host; raises the watchdog's
        error if this communicator already failed (a timeout or an NCCL error)."""
        self._comm.raise_if_failed()
        torch.cuda.current_stream().wait_event(self._event)
