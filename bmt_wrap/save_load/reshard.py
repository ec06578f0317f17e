"""Where a rank's (or a file's) part of a tensor sits in the whole tensor, and copying between two layouts.

Under tensor parallelism (TP) a parameter is first cut into ``tp_size`` equal slices along its split
dimension, and then ZeRO keeps a flat element range of one slice on each data-parallel rank. A
``Piece`` says both: the TP cut (dimension, index, size; none for a tensor TP does not split) and the
flat ``[start, end)`` range of that slice. Its elements form at most ``2 * ndim - 1`` boxes of the whole
tensor (``local_shard.flat_range_boxes``), each contiguous in the piece's 1-D data, so the elements two
pieces share are box intersections, copied as strided views: a checkpoint saved at one (tp, dp) layout
reads exactly into any other (or into one whole tensor), with no collective. Pure: no files, no ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .local_shard import Box, flat_range_boxes


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of the flattened TP slice ``tp_index`` of ``tp_size`` along ``tp_dim``
    (``tp_dim`` None: of the whole tensor)."""

    start: int
    end: int
    tp_dim: int | None = None
    tp_index: int = 0
    tp_size: int = 1

    @property
    def numel(self) -> int:
        """Elements held."""
        return self.end - self.start

    def region(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the whole tensor of ``shape`` of the slice the flat range indexes."""
        if self.tp_dim is None:
            return (0,) * len(shape), tuple(shape)
        sizes = list(shape)
        sizes[self.tp_dim] //= self.tp_size
        offsets = [0] * len(shape)
        offsets[self.tp_dim] = self.tp_index * sizes[self.tp_dim]
        return tuple(offsets), tuple(sizes)

    def boxes(self, shape: tuple[int, ...]) -> list[Box]:
        """The boxes of the whole tensor this piece holds: (offsets, sizes, first element in the piece's data)."""
        origin, sizes = self.region(shape)
        return [(tuple(o + a for o, a in zip(offsets, origin, strict=True)), box, first - self.start)
                for offsets, box, first in flat_range_boxes(sizes, self.start, self.end)]


def whole(shape: tuple[int, ...]) -> Piece:
    """The piece that is the whole tensor."""
    return Piece(0, math.prod(shape))


def overlaps(shape: tuple[int, ...], mine: Piece, theirs: Piece) -> list[tuple[Box, Box]]:
    """(my box, their box) pairs that share elements; empty when the pieces are disjoint."""
    if mine.numel == 0 or theirs.numel == 0:
        return []
    out = []
    for a in mine.boxes(shape):
        for b in theirs.boxes(shape):
            if all(lo < hi for lo, hi in _intersection(a, b)):
                out.append((a, b))
    return out


def shared(pairs: list[tuple[Box, Box]]) -> int:
    """Elements the box pairs share."""
    return sum(math.prod(hi - lo for lo, hi in _intersection(a, b)) for a, b in pairs)


def span(pairs: list[tuple[Box, Box]]) -> tuple[int, int]:
    """``[start, end)`` of the other piece's data that ``pairs`` read (one contiguous read)."""
    return (min(b[2] for _, b in pairs), max(b[2] + math.prod(b[1]) for _, b in pairs))


def copy_overlaps(dst: torch.Tensor, src: torch.Tensor, src_start: int, pairs: list[tuple[Box, Box]]) -> None:
    """Copy every shared box from ``src`` (the other piece's data from element ``src_start`` on) into
    ``dst`` (my piece's 1-D data)."""
    for a, b in pairs:
        shared_box = _intersection(a, b)
        _view(dst, a, 0, shared_box).copy_(_view(src, b, src_start, shared_box))


def _intersection(a: Box, b: Box) -> list[tuple[int, int]]:
    """Per dimension, ``[lo, hi)`` of the whole tensor that boxes ``a`` and ``b`` share (empty: lo >= hi)."""
    return [(max(oa, ob), min(oa + sa, ob + sb)) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True)]


def _view(data: torch.Tensor, box: Box, data_start: int, part: list[tuple[int, int]]) -> torch.Tensor:
    """The elements ``part`` of ``box`` in ``data`` (a piece's 1-D data from element ``data_start`` on)."""
    offsets, sizes, first = box
    a = first - data_start
    return data[a:a + math.prod(sizes)].view(sizes)[tuple(slice(lo - o, hi - o)
                                                          for (lo, hi), o in zip(part, offsets, strict=True))]
