"""``AdamDiskOptimizer``: AdamOptimizer whose moments (and fp32 masters) live in a file, not in memory."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..base.dtypes import LOW_PRECISION
from ..errors import OptimizerError
from ..job.distributed import current_state
from ..runtime.offload import release_pages
from ..runtime.sharded_tensor import local_view
from . import torch_adam
from .adam import AdamOptimizer
from .adam_math import AdamHyper
from .state_file import IOStats, StateFile

#: Default staging buffer: 32 MiB, a pass over 4M fp32 parameter elements (two 4-byte moments each) or
#: 2M bf16 ones (moments, master and the gradient's fp32 copy).
DEFAULT_CHUNK_BYTES = 32 * 2**20

#: Chunks are cut at multiples of this many elements from the start of a fused range, so the fused kernel
#: (whose vector loops and per-thread ranges work in 64-byte units) rounds every element as it would in
#: one call over the whole range: results stay bit-equal to ``AdamOptimizer``'s.
ALIGN_ELEMS = 64
#: The buffer must hold ``ALIGN_ELEMS`` elements of the widest state: three fp64 fields and fp32 scratch.
MIN_CHUNK_BYTES = ALIGN_ELEMS * (3 * 8 + 4)


class _Region(NamedTuple):
    """State of parameters that are adjacent views of one buffer, in the file: each field's ``length``
    elements (gaps between the parameters included, as zeros), one field after another."""

    offset: int
    length: int
    dtype: torch.dtype
    fields: tuple[str, ...]

    def at(self, field: int, start: int) -> int:
        """File offset of element ``start`` of ``field``."""
        return self.offset + (field * self.length + start) * self.dtype.itemsize


class _Place(NamedTuple):
    """One parameter's elements within its region."""

    region: _Region
    start: int
    numel: int


class _Piece(NamedTuple):
    """1-D ranges of parameter and gradient that the in-memory optimizer updates as one tensor, whose
    state starts at element ``state_start`` of ``region``."""

    param: torch.Tensor
    grad: torch.Tensor
    region: _Region
    state_start: int
    hyper: AdamHyper


class AdamDiskOptimizer(AdamOptimizer):
    """``AdamOptimizer`` (``torch.optim.AdamW`` semantics, bit-equal results) whose Adam moments, and fp32
    masters where the parameter is fp16/bf16 or not on the CPU, live in a file of this process's own under
    ``offload_dir``, so memory no longer grows with them.

    Each step streams every parameter's state through one ``chunk_bytes`` buffer: read a range's moments
    (and master), update the parameter in place, write them back. ``last_step_io`` and ``io_stats`` count
    the bytes read and written (last step; since construction). ``state_dict()`` reads the state into memory
    for the caller; ``load_state_dict()`` writes it to the file. ``close()`` (or collection, or exit)
    deletes the file. Put ``offload_dir`` on a disk: on tmpfs the file's pages are memory again.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 hold_steps: int = 0, *, offload_dir: str | os.PathLike[str],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise OptimizerError(f"chunk_bytes={chunk_bytes} is too small: give at least {MIN_CHUNK_BYTES} "
                                 f"(the default is {DEFAULT_CHUNK_BYTES})")
        super().__init__(params, lr, betas, eps, weight_decay, hold_steps)
        state = current_state()
        self._file = StateFile(offload_dir, chunk_bytes, prefix=f"bmt_adam_rank{state.rank if state else 0}_")
        self._places: dict[torch.Tensor, _Place] = {}
        self._written: set[torch.Tensor] = set()  # parameters whose state was ever written to the file
        #: Bytes read from and written to the state file by the last ``step()``.
        self.last_step_io = IOStats()

    @property
    def io_stats(self) -> IOStats:
        """Bytes read from and written to the state file since construction (steps and checkpoints)."""
        return self._file.stats

    @property
    def state_path(self) -> str:
        """The file holding this process's optimizer state."""
        return self._file.path

    def close(self) -> None:
        """Delete the state file; the optimizer cannot step afterwards."""
        self._file.close()

    # ---- where the state lives ----------------------------------------------------------------------
    def _keeps_master(self, p: torch.Tensor) -> bool:
        # A CPU fp32/fp64 parameter is its own master; any other needs an fp32 copy to update on the CPU.
        return p.dtype in LOW_PRECISION or p.device.type != "cpu"

    def _region(self, like: torch.Tensor, length: int) -> _Region:
        fields = ("exp_avg", "exp_avg_sq") + (("master",) if self._keeps_master(like) else ())
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return _Region(self._file.allocate(len(fields) * length * dtype.itemsize), length, dtype, fields)

    def _reserve(self) -> None:
        """Place every trainable parameter not yet placed as ``AdamOptimizer`` lays out its memory: adjacent
        views of one flat buffer share a region, at the same relative offsets, so runs fuse over it too."""
        for cover, members in self._layout_runs(self._places):
            region = self._region(cover, cover.numel())
            for p, local, start in members:
                self._places[p] = _Place(region, start, local.numel())

    def _place(self, p: torch.Tensor) -> _Place:
        """``p``'s place in the file."""
        if p not in self._places:
            self._reserve()
        if p not in self._places:  # empty or frozen: nothing to share a region with
            self._places[p] = _Place(self._region(p, local_view(p).numel()), 0, local_view(p).numel())
        return self._places[p]

    def _chunk_elems(self, region: _Region, extra_bytes: int = 0) -> int:
        """Elements per pass (a multiple of ``ALIGN_ELEMS``), each needing every field and ``extra_bytes``."""
        per_elem = len(region.fields) * region.dtype.itemsize + extra_bytes
        return self._file.buffer.numel() // per_elem // ALIGN_ELEMS * ALIGN_ELEMS

    def _slots(self, region: _Region, count: int) -> list[torch.Tensor]:
        """``count`` elements of buffer per field, one after another, then ``count`` fp32 of scratch."""
        size = count * region.dtype.itemsize
        buf = self._file.buffer
        slots = [buf[i * size:(i + 1) * size].view(region.dtype) for i in range(len(region.fields))]
        rest = len(region.fields) * size
        return slots + [buf[rest:rest + 4 * count].view(torch.float32)]

    def _init_state(self, p: torch.Tensor, state: dict[str, Any],
                    saved: dict[str, Any] | None = None) -> None:
        """Fresh state for ``p`` (moments zero, master from the parameter), or the ``saved`` one, written
        to the file through the buffer."""
        saved = saved or {}
        place = self._place(p)
        region = place.region
        sources: dict[str, torch.Tensor | None] = {}
        for name in region.fields:
            source = saved.get(name)
            if source is not None:
                source = local_view(source)
                if source.numel() != place.numel:
                    raise OptimizerError(f"saved {name} has {source.numel()} elements, the parameter's range "
                                         f"{place.numel}: the checkpoint was saved with another layout")
                sources[name] = source.reshape(-1)
            elif name == "master":
                sources[name] = local_view(p).detach().reshape(-1)
            elif p in self._written:
                sources[name] = None  # zeros over an earlier state (a file range starts as zeros)
        chunk = self._chunk_elems(region)
        for f, name in enumerate(region.fields):
            if name not in sources:
                continue
            for start in range(0, place.numel, chunk):
                count = min(chunk, place.numel - start)
                slot = self._slots(region, count)[0]
                source = sources[name]
                if source is None:
                    slot.zero_()
                else:
                    slot.copy_(source[start:start + count])
                self._file.write(slot, region.at(f, place.start + start))
        self._written.add(p)
        state.clear()
        state.update(step=int(saved.get("step", 0)))

    def _read_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s state tensors, read from the file into new memory shaped like its local range."""
        place = self._places[p]
        out = {}
        for f, name in enumerate(place.region.fields):
            t = torch.empty(place.numel, dtype=place.region.dtype)
            self._file.read(t, place.region.at(f, place.start))
            out[name] = t.view(local_view(p).shape)
        return out

    # ---- the update -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, scale: float = 1.0) -> Any:
        """One Adam update of every parameter with a gradient, streaming its state through the buffer."""
        read, written = self._file.stats.read, self._file.stats.written
        loss, params, items, hypers, keys = self._begin_step(closure)
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        pieces: list[_Piece] = []
        for run in self._plans.plan(items, keys):
            for members in self._by_region(params, run.members):
                pieces.append(self._piece(params, items, members, hypers[members[0]], write_back))
        calls = sum(self._update(piece, scale) for piece in self._as_in_memory(pieces))
        for param, dense in write_back:
            param.copy_(dense)
        self.last_step_io = IOStats(self._file.stats.read - read, self._file.stats.written - written)
        self.last_step_runs = calls
        return loss

    def _item(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local = local_view(p).detach()
        if p.grad is None:
            return (local,)
        grad = self._dense_grad(p)
        state = self.state[p]
        if state and p not in self._places:
            raise OptimizerError(f"{type(self).__name__} has state for a parameter it never placed in its "
                                 "file (set in optimizer.state by hand?): give state with load_state_dict()")
        if not state:
            self._init_state(p, state)
        return (local, grad)

    def _by_region(self, params: list[torch.Tensor], members: tuple[int, ...]) -> list[tuple[int, ...]]:
        """A run's members split where their state changes region (parameters placed at different times)."""
        groups: list[list[int]] = []
        for i in members:
            if groups and self._places[params[groups[-1][-1]]].region == self._places[params[i]].region:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [tuple(g) for g in groups]

    def _piece(self, params: list[torch.Tensor], items: list[tuple[torch.Tensor, ...]],
               members: tuple[int, ...], hyper: AdamHyper,
               write_back: list[tuple[torch.Tensor, torch.Tensor]]) -> _Piece:
        """The 1-D parameter and gradient covering ``members`` (adjacent in memory and in the file)."""
        first, last = items[members[0]][0], items[members[-1]][0]
        place = self._places[params[members[0]]]
        if len(members) == 1:
            param, grad = first, items[members[0]][1]
            if not param.is_contiguous():  # a lone strided parameter: the fused kernels want dense memory
                write_back.append((param, param.contiguous()))
                param = write_back[-1][1]
            return _Piece(param.view(-1), grad.contiguous().view(-1), place.region, place.start, hyper)
        length = last.storage_offset() + last.numel() - first.storage_offset()
        grad = items[members[0]][1]
        return _Piece(first.as_strided((length,), (1,)), grad.as_strided((length,), (1,)), place.region,
                      place.start, hyper)

    def _as_in_memory(self, pieces: list[_Piece]) -> list[_Piece]:
        """``pieces`` cut where ``AdamOptimizer`` cuts them: ranges with a master pass through its fp32
        scratch of ``SCRATCH_ELEMS``, filled across the ranges of one hyperparameter class in order."""
        out = [p for p in pieces if "master" not in p.region.fields]
        by_hyper: dict[AdamHyper, list[_Piece]] = {}
        for p in pieces:
            if "master" in p.region.fields:
                by_hyper.setdefault(p.hyper, []).append(p)
        for batch in by_hyper.values():
            used = 0
            for p in batch:
                n, start = p.param.numel(), 0
                while start < n:
                    take = min(n - start, torch_adam.SCRATCH_ELEMS - used)
                    out.append(p._replace(param=p.param[start:start + take], grad=p.grad[start:start + take],
                                          state_start=p.state_start + start))
                    used = (used + take) % torch_adam.SCRATCH_ELEMS
                    start += take
        return out

    def _update(self, piece: _Piece, scale: float) -> int:
        """Update ``piece`` chunk by chunk: read its state, update, write it back. Returns the calls made."""
        region = piece.region
        master = "master" in region.fields
        chunk = self._chunk_elems(region, 4 if master else 0)  # the master path converts gradients in scratch
        n = piece.param.numel()
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            *states, scratch = self._slots(region, count)
            for f, slot in enumerate(states):
                self._file.read(slot, region.at(f, piece.state_start + start))
            param, grad = piece.param[start:start + count], piece.grad[start:start + count]
            if master:
                torch_adam.step_with_master([(param, grad, states[2], states[0], states[1])], piece.hyper,
                                            scale, scratch)
            else:
                torch_adam.step_in_place([param], [grad], [states[0]], [states[1]], piece.hyper, scale)
            for f, slot in enumerate(states):
                self._file.write(slot, region.at(f, piece.state_start + start))
            release_pages(param, grad)  # offloaded shards (offload="disk"): updated, so out of memory again
        return -(-n // chunk)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def full_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """``self.state`` as ``AdamOptimizer`` keeps it (what checkpoints save): each parameter's state
        tensors read from the file into new memory, beside its step count."""
        return defaultdict(dict, {p: {**st, **self._read_state(p)} if p in self._places else dict(st)
                                  for p, st in self.state.items()})

    def state_dict(self) -> dict[str, Any]:
        """The state as ``AdamOptimizer`` gives it: its tensors are read from the file into memory."""
        live, self.state = self.state, self.full_state()
        try:
            return super().state_dict()
        finally:
            self.state = live
