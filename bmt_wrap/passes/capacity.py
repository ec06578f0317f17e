"""A training process's peak memory per rank, and the largest model that fits a memory limit
(docs/design.md "Capacity: the process's peak").

``estimate`` counts the tensors a plan keeps; a process holds more: what it held before the model
(the process baseline: the interpreter, torch, bmt_wrap), the model built before wrapping (a full copy,
unless it was built on the meta device and loaded by ``bmt.from_pretrained``/``bmt.load``), and the root
group's backward, which ``estimate`` leaves out because no block holds it: the root's full gradient lives
from its first use in backward to the end (the reduce-scatter comes after its last use), each use's
gradient is made before it is added in, and the reduce-scatter receives the other ranks' parts.
Tensors are counted, not the allocator's holes: the count is the process's peak when freed tensors leave
the process (on CPU, glibc with ``MALLOC_MMAP_THRESHOLD_=65536``; docs/design.md "Capacity").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..base.plan import MemoryEstimate, WrapPlan
from ..errors import PlanError


@dataclass(frozen=True)
class ProcessPeak:
    """Bytes per rank: the process baseline, then the larger of wrapping's and training's peaks above it."""

    baseline: int
    wrapping: int  # the full copy built before wrapping, the shard made from it, the pooled buffers
    training: int  # the plan's estimate plus the root group's backward

    @property
    def total(self) -> int:
        """The process's peak resident bytes."""
        return self.baseline + max(self.wrapping, self.training)


def root_backward_bytes(plan: WrapPlan, world_size: int) -> int:
    """What the root group's backward holds beyond ``estimate``: its full gradient, one use's gradient
    before it is added in, and the reduce-scatter's received (N-1)/N."""
    full = sum(b.full_grad_bytes(world_size) for g in plan.groups if g.is_root
               for b in g.buffers if b.requires_grad)
    return 2 * full + full * (world_size - 1) // world_size


def process_peak(plan: WrapPlan, est: MemoryEstimate, baseline: int, built_full: bool = True) -> ProcessPeak:
    """Peak bytes per rank of a process training ``plan`` at ``est``'s world size. ``built_full``: the model
    was built with real weights before wrapping (False when built on the meta device and loaded)."""
    n = est.world_size if est.shard_size is None else est.shard_size
    full = sum(g.param_bytes() for g in plan.groups) if built_full else 0
    wrapping = full + est.params + est.gathered if built_full else 0
    return ProcessPeak(baseline, wrapping, est.total + root_backward_bytes(plan, n))


def optimizer_on_disk(est: MemoryEstimate, buffer_bytes: int) -> tuple[MemoryEstimate, int]:
    """``est`` with the optimizer state in a file (``bmt.optim.AdamDiskOptimizer``), and the bytes it reads
    per step per rank (it writes as many back): memory keeps only the staging buffer (no more of it than the
    state itself touches), and every step streams the whole state through it once."""
    return replace(est, optimizer=min(buffer_bytes, est.optimizer)), est.optimizer


def largest_fitting(peak_of: Callable[[int], int], limit: int, start: int = 1) -> tuple[int, int]:
    """The largest ``k >= 1`` with ``peak_of(k) <= limit`` (peaks grow with ``k``), and its peak: doubling
    from ``start``, then bisection. ``PlanError`` when even ``k = 1`` does not fit."""
    peaks: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in peaks:
            peaks[k] = peak_of(k)
        return peaks[k] <= limit

    if not fits(1):
        raise PlanError(f"even the smallest model (1) needs {peaks[1]:,} bytes per rank, over the limit of "
                        f"{limit:,}: give more memory or more ranks")
    lo, hi = 1, max(start, 2)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, peaks[lo]
