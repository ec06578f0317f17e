"""Where a rank's (or a file's) part of a tensor sits in the whole tensor, and copying between two layouts.

Under tensor parallelism (TP) a parameter is first cut into ``tp_size`` equal slices along its split
dimension, and then ZeRO keeps a flat element range of one slice on each data-parallel rank. A
``Piece`` says both: the TP cut (dimension, index, size; none for a tensor TP does not split) and the
flat ``[start, end)`` range of that slice. Its elements form at most ``2 * ndim - 1`` boxes of the whole
tensor (``local_shard.flat_range_boxes``), each contiguous in the piece's 1-D data, so the elements two
pieces share are box intersections, copied as strided views: a checkpoint saved at one (tp, dp) layout
reads exactly into any other (or into one whole tensor), with no collective. Pure: no files, no ranks.

A strided split (``tp_parts`` > 1: GPT-2's fused q/k/v, ``runtime/tp_marks.py``) is a plain cut in the
*grid* where the split dimension is viewed as ``(parts, -1)``: two pieces of one tensor are intersected
there (same row-major order, so the same flat data), and ``boxes`` maps a piece back to boxes of the real
shape for DCP, one per block and row before the split dimension.
"""

from __future__ import annotations

import itertools
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
    tp_parts: int = 1  # blocks along tp_dim, each cut over the TP group (a strided split)

    @property
    def numel(self) -> int:
        """Elements held."""
        return self.end - self.start

    def region(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the whole tensor of ``shape`` of the slice the flat range indexes (a strided
        split: in its grid, ``grid``)."""
        if self.tp_parts > 1 and self.tp_dim is not None:
            return self.in_grid(shape, self.tp_dim, self.tp_parts).region(grid(shape, self.tp_dim, self.tp_parts))
        if self.tp_dim is None:
            return (0,) * len(shape), tuple(shape)
        sizes = list(shape)
        sizes[self.tp_dim] //= self.tp_size
        offsets = [0] * len(shape)
        offsets[self.tp_dim] = self.tp_index * sizes[self.tp_dim]
        return tuple(offsets), tuple(sizes)

    def boxes(self, shape: tuple[int, ...]) -> list[Box]:
        """The boxes of the whole tensor this piece holds: (offsets, sizes, first element in the piece's data)."""
        if self.tp_parts > 1 and self.tp_dim is not None:
            dim, parts = self.tp_dim, self.tp_parts
            return _ungrid(self.in_grid(shape, dim, parts).boxes(grid(shape, dim, parts)), dim, shape[dim] // parts)
        origin, sizes = self.region(shape)
        return [(tuple(o + a for o, a in zip(offsets, origin, strict=True)), box, first - self.start)
                for offsets, box, first in flat_range_boxes(sizes, self.start, self.end)]

    def in_grid(self, shape: tuple[int, ...], dim: int | None, parts: int) -> Piece:
        """This piece in ``grid(shape, dim, parts)``, where it is a plain cut (or no cut)."""
        if dim is None or parts == 1:
            return self
        if self.tp_dim == dim and self.tp_parts != parts:
            raise ValueError(f"a TP cut of dimension {dim} in {self.tp_parts} block(s) and one in {parts} "
                             f"block(s) of the same tensor of shape {tuple(shape)}: the layouts differ")
        tp_dim = self.tp_dim if self.tp_dim is None or self.tp_dim < dim else self.tp_dim + 1
        return Piece(self.start, self.end, tp_dim, self.tp_index, self.tp_size)


def grid(shape: tuple[int, ...], dim: int | None, parts: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` viewed as ``(parts, shape[dim] // parts)`` (``tp_marks.tp_blocks``)."""
    if dim is None or parts == 1:
        return tuple(shape)
    return (*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1:])


def _common_grid(mine: Piece, theirs: Piece) -> tuple[int | None, int]:
    """(dim, parts) of the grid both pieces are plain cuts in: a strided piece's, else none."""
    strided = mine if mine.tp_parts > 1 else theirs
    return (strided.tp_dim, strided.tp_parts) if strided.tp_parts > 1 else (None, 1)


def _ungrid(boxes: list[Box], dim: int, width: int) -> list[Box]:
    """Boxes of a grid (``dim`` viewed as blocks of ``width``) as boxes of the real shape, each still
    contiguous in the piece's data: a box spanning several blocks becomes one per block and per index of
    the dimensions before ``dim``."""
    out: list[Box] = []
    for offsets, sizes, first in boxes:
        outer = sizes[:dim + 1]  # the dimensions before dim, and the block index
        inner = math.prod(sizes[dim + 1:])
        for k, index in enumerate(itertools.product(*map(range, outer))):
            at = tuple(o + i for o, i in zip(offsets, index, strict=False))
            real = (*at[:dim], at[dim] * width + offsets[dim + 1], *offsets[dim + 2:])
            size = (*[1] * dim, sizes[dim + 1], *sizes[dim + 2:])
            out.append((real, size, first + k * inner))
    return out


def whole(shape: tuple[int, ...]) -> Piece:
    """The piece that is the whole tensor."""
    return Piece(0, math.prod(shape))


def overlaps(shape: tuple[int, ...], mine: Piece, theirs: Piece) -> list[tuple[Box, Box]]:
    """(my box, their box) pairs that share elements; empty when the pieces are disjoint."""
    if mine.numel == 0 or theirs.numel == 0:
        return []
    dim, parts = _common_grid(mine, theirs)  # a strided split's boxes are intersected in its grid
    cells = grid(shape, dim, parts)
    out = []
    for a in mine.in_grid(shape, dim, parts).boxes(cells):
        for b in theirs.in_grid(shape, dim, parts).boxes(cells):
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
