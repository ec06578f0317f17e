"""Find runs of parameters that are adjacent views of one flat buffer, so one call updates each run.

Detection is generic: it looks only at storages, offsets and strides, so it fuses the engine's flat
shards (one storage per group and dtype, parameters separated by alignment gaps) and degrades to one
run per tensor for ordinary parameters. Every tensor a run touches (parameter, gradient, optimizer
state) must sit at the same relative offsets in its own storage, and the gap memory between members
must be zero in each of them: an update of a zero gap with a zero gradient leaves it zero, so covering
the gaps is harmless, while non-zero memory there belongs to someone else and splits the run.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..base.dtypes import align_elems


@dataclass(frozen=True)
class Run:
    """Members (indices into the planned list, in storage order) covering ``length`` elements.

    Plans hold no tensors (a cached plan must not keep freed gradients alive); ``views`` rebuilds the
    covering views from the current tensors.
    """

    members: tuple[int, ...]
    length: int

    def views(self, tensors: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """One view per tensor kind: a one-member run's tensors as they are (any shape or strides), a
        longer run's 1-D span from its first member's start over its last member's end."""
        first = tensors[self.members[0]]
        if len(self.members) == 1:
            return tuple(t.detach() for t in first)
        return tuple(_span(t, t.storage_offset(), self.length) for t in first)


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _span(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.detach().as_strided((length,), (1,), start)


def _joinable(prev: Sequence[torch.Tensor], nxt: Sequence[torch.Tensor]) -> bool:
    """Whether ``nxt`` continues ``prev`` at the same small, zero gap in every tensor kind."""
    anchor_gap = nxt[0].storage_offset() - (prev[0].storage_offset() + prev[0].numel())
    if not 0 <= anchor_gap < align_elems(nxt[0].dtype):
        return False
    for a, b in zip(prev, nxt, strict=True):
        if (a.dtype != b.dtype or not b.is_contiguous() or _storage_key(a) != _storage_key(b)
                or b.storage_offset() - a.storage_offset() != nxt[0].storage_offset() - prev[0].storage_offset()):
            return False
    if anchor_gap == 0:
        return True
    return not any(bool(_span(a, a.storage_offset() + a.numel(), anchor_gap).any()) for a in prev)


def plan_runs(tensors: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable | None]) -> list[Run]:
    """Group tensor tuples into fusable runs.

    ``tensors[i]`` holds item i's same-shaped tensors updated together (its parameter first, then e.g.
    gradient and moments); items fuse only when their ``keys`` (hyperparameters, step) are equal. An
    item whose key is None is managed but not updated now (a parameter without a gradient): it
    appears in no run and splits any run across it, since updating a covering range would touch it.
    Empty items take no memory and are left out.
    """
    present = [i for i, ts in enumerate(tensors) if ts[0].numel() > 0]
    order = sorted(present, key=lambda i: (str(tensors[i][0].device), _storage_key(tensors[i][0])[1],
                                           tensors[i][0].storage_offset()))
    runs: list[Run] = []
    current: list[int] = []

    def close() -> None:
        if current:
            first, last = tensors[current[0]][0], tensors[current[-1]][0]
            runs.append(Run(tuple(current), last.storage_offset() + last.numel() - first.storage_offset()))
        current.clear()

    for i in order:
        if current and (keys[current[-1]] != keys[i] or not tensors[current[-1]][0].is_contiguous()
                        or not _joinable(tensors[current[-1]], tensors[i])):
            close()
        if keys[i] is not None:
            current.append(i)
    close()
    return runs


def _signature(tensors: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable | None]) -> tuple:
    return tuple((keys[i],) + tuple((_storage_key(t), t.storage_offset(), t.shape, t.stride(), t.dtype) for t in ts)
                 for i, ts in enumerate(tensors))


class PlanCache:
    """``plan_runs`` memoised on the layout (storages, offsets, shapes, keys): planning checks gap
    memory, so it runs once per distinct layout rather than every step."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: dict[tuple, list[Run]] = {}

    def plan(self, tensors: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable | None]) -> list[Run]:
        """The runs for this layout, planned on first sight."""
        sig = _signature(tensors, keys)
        runs = self._plans.get(sig)
        if runs is None:
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))
            runs = self._plans[sig] = plan_runs(tensors, keys)
        return runs
