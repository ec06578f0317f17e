"""Offloaded shards (``offload="disk"``): each rank's parameter shards, gradient shards and ``no_sync``
accumulators live in a file of its own, not in the process's memory.

Each flat buffer's shard (and gradient shard, and accumulator) is a shared mapping of its own page-aligned
range of the file (``ShardFile``, the mapping backend of ``shard_store.ShardStore``), so every reader — the engine's gathers, optimizers, ``clip_grad_norm_``,
checkpoints, user code — sees an ordinary tensor, and the parameter objects never change. What keeps the
memory out of the process is dropping the pages once they are used (``madvise(MADV_DONTNEED)``: a shared
file mapping keeps its data in the file and the kernel's page cache, which belongs to no process, is written
back to disk and is reclaimed under pressure): a shard after its all-gather, a gradient shard when its
reduce-scatter ends, a parameter's range after the optimizer updated it, everything at the start of a
forward and after every optimizer step. Reads of the next block's shard are started on a background thread
one block ahead of its gather (``MADV_POPULATE_READ``), so they overlap the running block's compute.

Every range is reserved on disk when the model is wrapped (``BackingFile.allocate``), so a full disk is an
error then, on every rank (``agree_offload``), never a ``SIGBUS`` through a mapping later; a file truncated
while the job runs is found at the next forward, on every rank, before any mapping is read.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..base.log import says_for_node
from ..base.plan import fmt_bytes
from ..errors import OffloadError, OffloadWarning
from .backing_file import BackingFile
from .comm import Communicator
from .shard_store import ShardStore

_PAGE = mmap.PAGESIZE
_MADV_WILLNEED, _MADV_DONTNEED, _MADV_POPULATE_READ = 3, 4, 22
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

#: An optimizer whose in-memory state for offloaded parameters reaches this fraction of their shards' bytes
#: undoes much of the offload, and is told so at its first step (``check_kept_state``). State that does not
#: grow with the parameters (Adafactor's factored moments, step counts) stays below it; a momentum buffer
#: (1x) or Adam's moments (2x) do not.
KEPT_STATE_WARN_FRACTION = 0.25
_STATE_CHECKED = "_bmt_offload_state_checked"

#: Bytes of mapped pages that ops outside the engine's schedule (a torch optimizer's per-parameter ops, user
#: code) may leave mapped before the oldest are dropped (``note_touched``).
TOUCHED_BUDGET = 64 * 2**20

# Live mappings, by start address: only these ranges are ever given MADV_DONTNEED (on anonymous memory it
# would zero the pages). An entry leaves when its mmap object is collected, which unmaps it.
_starts: list[int] = []
_ends: dict[int, int] = {}
_files: weakref.WeakSet[ShardFile] = weakref.WeakSet()


def _register(start: int, end: int) -> None:
    bisect.insort(_starts, start)
    _ends[start] = end


def _unregister(start: int) -> None:
    i = bisect.bisect_left(_starts, start)
    if i < len(_starts) and _starts[i] == start:
        del _starts[i]
    _ends.pop(start, None)


def _span(addr: int) -> tuple[int, int] | None:
    """The live mapping holding address ``addr``, or None."""
    i = bisect.bisect_right(_starts, addr) - 1
    if i < 0:
        return None
    start = _starts[i]
    end = _ends[start]
    return (start, end) if addr < end else None


def _advise(start: int, end: int, advice: int) -> None:
    if end > start and _libc.madvise(start, end - start, advice) != 0 and advice == _MADV_DONTNEED:
        err = ctypes.get_errno()
        raise OffloadError(f"dropping offloaded pages failed: {os.strerror(err)}")


def _pages(t: torch.Tensor) -> tuple[int, int] | None:
    """The pages of ``t``'s memory, rounded out to whole pages within its mapping (dropping a neighbour's
    page too only costs a re-read: the file keeps every value), or None if ``t`` is not mapped."""
    if t.numel() == 0:
        return None
    addr = t.data_ptr()
    span = _span(addr)
    if span is None:
        return None
    end = min(addr + t.numel() * t.element_size(), span[1])
    return addr // _PAGE * _PAGE, min(-(-end // _PAGE) * _PAGE, span[1])


def active() -> bool:
    """True while any offloaded tensor is mapped in this process."""
    return bool(_starts)


def is_offloaded(t: torch.Tensor) -> bool:
    """True when ``t``'s memory is a mapping of an offload file."""
    return bool(_starts) and t.numel() > 0 and _span(t.data_ptr()) is not None


def release_pages(*tensors: torch.Tensor) -> None:
    """Drop the pages of offloaded tensors from this process (their values stay in the file)."""
    if not _starts:
        return
    for t in tensors:
        pages = _pages(t)
        if pages is not None:
            _advise(*pages, _MADV_DONTNEED)
            _touched.pop(pages[0], None)


def release_all() -> None:
    """Drop every offloaded page this process has mapped (after an optimizer step, before a forward)."""
    for start in list(_starts):
        _advise(start, _ends[start], _MADV_DONTNEED)
    _touched.clear()


# Ranges ops outside the schedule touched, oldest first: start -> end.
_touched: OrderedDict[int, int] = OrderedDict()


def note_touched(t: torch.Tensor) -> None:
    """``t`` was just read or written by an op outside the engine's schedule: keep its pages until
    ``TOUCHED_BUDGET`` bytes of such pages are mapped, then drop the oldest."""
    pages = _pages(t)
    if pages is None:
        return
    _touched.pop(pages[0], None)
    _touched[pages[0]] = pages[1]
    total = sum(e - s for s, e in _touched.items())
    while total > TOUCHED_BUDGET and len(_touched) > 1:
        start, end = _touched.popitem(last=False)
        if _span(start) is not None:  # still mapped
            _advise(start, end, _MADV_DONTNEED)
        total -= end - start


_HOOKS: list[object] = []


def _local(t: torch.Tensor) -> torch.Tensor:
    # A sharded tensor's memory is its local range (sharded_tensor.py imports this module: duck-typed).
    return t.to_local() if hasattr(t, "to_local") else t


def _check_before_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    # Only the files this optimizer reads: another model's broken file (one waiting for the collector after
    # its own error) must not stop an optimizer that never touches it.
    params = [_local(p) for group in optimizer.param_groups for p in group["params"]]
    for f in list(_files):
        if not f.closed and any(f.holds(p) for p in params):
            problem = f.truncated()
            if problem is not None:
                raise OffloadError(problem)


def check_kept_state(optimizer: torch.optim.Optimizer) -> None:
    """At the first step that gave an offloaded parameter of ``optimizer`` a gradient: warn once
    (``OffloadWarning``) if the state it keeps for them in memory undoes much of the offload."""
    if not _starts or optimizer.__dict__.get(_STATE_CHECKED):
        return
    shards, stepped, kept, seen = 0, False, 0, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = _local(p)
            if not is_offloaded(local):
                continue
            shards += local.numel() * local.element_size()
            stepped = stepped or p.grad is not None
            for value in optimizer.state.get(p, {}).values():
                t = _local(value) if isinstance(value, torch.Tensor) else None
                if t is not None and t.numel() and not is_offloaded(t) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())  # views shared between parameters counted once
                    kept += t.numel() * t.element_size()
    if shards and not stepped:
        return  # no state yet: the check waits for a step that makes it
    optimizer.__dict__[_STATE_CHECKED] = True
    if shards and kept >= KEPT_STATE_WARN_FRACTION * shards and says_for_node():
        warnings.warn(
            f"{type(optimizer).__name__} keeps {fmt_bytes(kept)} of optimizer state in this process's memory, "
            f"{kept / shards:.1f}x the {fmt_bytes(shards)} of parameter shards offload='disk' keeps in a file: "
            "only part of the model's states is offloaded. For Adam use bmt.optim.AdamDiskOptimizer("
            "model.parameters(), offload_dir=...), which keeps its moments (and fp32 masters) in a file too "
            "(docs/offload.md; said by local rank 0 for the node's ranks)", OffloadWarning, stacklevel=4)


def _after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    check_kept_state(optimizer)
    release_all()


def _install_step_hooks() -> None:
    """Every optimizer's step: checks the offload files are whole before it reads them; after it, says once
    if its state stays in memory, and drops what it touched (a torch optimizer reads each parameter's shard
    and gradient once)."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_check_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))


@dataclass
class ReadStats:
    """Read-ahead of offloaded shards: seconds the reads took on the reader thread, and seconds a gather
    waited for them (the part of the reads the compute did not hide)."""

    read_s: float = 0.0
    waited_s: float = 0.0
    bytes_read: int = 0


class ShardFile(BackingFile, ShardStore):
    """One model's offloaded tensors on one rank (``offload="disk"``): ranges of one file, each mapped on its own."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        super().__init__(directory, f"bmt_offload_rank{rank}_", "offloaded shards", OffloadError,
                         name="shards.bin", closed_hint="the model it belonged to was deleted")
        self.stats = ReadStats()
        self._reader: ThreadPoolExecutor | None = None
        self._reads: dict[int, Future] = {}  # by start address: read-ahead in flight
        self._lock = threading.Lock()
        self._spans: list[tuple[int, int]] = []  # this file's mappings: (start, end) addresses
        _files.add(self)
        _install_step_hooks()

    @property
    def device(self) -> torch.device:
        """A mapping is host memory: the CPU job computes on it directly."""
        return torch.device("cpu")

    def reserve(self, numel: int, dtype: torch.dtype) -> tuple[int, int, torch.dtype]:
        """Reserve a page-aligned range for ``numel`` elements of ``dtype``: ``(offset, numel, dtype)``."""
        nbytes = max(numel * dtype.itemsize, 1)
        return (self.allocate(-(-nbytes // _PAGE) * _PAGE, align=_PAGE), numel, dtype)

    def map(self, region: tuple[int, int, torch.dtype]) -> torch.Tensor:  # type: ignore[override]
        """The tensor over a reserved range (values as last written there; zeros when never written)."""
        self._check_open()
        offset, numel, dtype = region
        nbytes = -(-max(numel * dtype.itemsize, 1) // _PAGE) * _PAGE
        mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        t = torch.frombuffer(mm, dtype=torch.uint8)[:numel * dtype.itemsize].view(dtype)
        start = t.data_ptr()
        _register(start, start + nbytes)
        self._spans.append((start, start + nbytes))
        weakref.finalize(mm, _unregister, start)
        return t

    def holds(self, t: torch.Tensor) -> bool:
        """True when ``t``'s memory lies in one of this file's mappings."""
        addr = t.data_ptr()
        return t.numel() > 0 and any(start <= addr < end for start, end in self._spans)

    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Start reading ``tensors``' pages on the reader thread (they are gathered next)."""
        spans = [p for p in (_pages(t) for t in tensors) if p is not None and p[0] not in self._reads]
        if not spans:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="bmt-offload-read")
        for lo, hi in spans:
            self._reads[lo] = self._reader.submit(self._populate, lo, hi)

    def _populate(self, lo: int, hi: int) -> None:
        start = time.perf_counter()
        # ctypes drops the GIL: the compute thread runs on while the kernel reads.
        if _libc.madvise(lo, hi - lo, _MADV_POPULATE_READ) != 0:
            _libc.madvise(lo, hi - lo, _MADV_WILLNEED)  # kernels before 5.14: readahead into the page cache
        with self._lock:
            self.stats.read_s += time.perf_counter() - start
            self.stats.bytes_read += hi - lo

    def wait_read(self, t: torch.Tensor) -> None:
        """Before reading ``t``: let its read-ahead finish (so it cannot map pages after they are dropped)."""
        pages = _pages(t)
        future = self._reads.pop(pages[0], None) if pages is not None else None
        if future is not None:
            start = time.perf_counter()
            future.result()
            with self._lock:
                self.stats.waited_s += time.perf_counter() - start


def agree_offload(comm: Communicator, problem: BaseException | str | None, what: str) -> None:
    """Raise ``OffloadError`` on every rank of ``comm`` if any rank has a ``problem`` (one all-reduce)."""
    flags = torch.zeros(comm.world_size, dtype=torch.float32)
    flags[comm.rank] = float(problem is not None)
    if comm.world_size > 1:
        comm.all_reduce(flags, "max", label=f"offload {what} verdict")
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    if problem is not None:
        if isinstance(problem, OffloadError):
            raise problem
        raise OffloadError(str(problem))
    raise OffloadError(f"{what}: rank(s) {failed} could not use their offload file (their error names it and "
                       "says why); every rank stops here so that none waits for them")


def check_files(comm: Communicator, files: list[ShardStore]) -> None:
    """Every rank's offload stores still hold what was written to them (before any mapping is read)."""
    problem = next((p for p in (f.truncated() for f in files) if p is not None), None)
    agree_offload(comm, problem, "file check")
