"""``LocalShard``: this rank's element range of a full tensor, in the form ``torch.distributed.checkpoint``
(DCP) saves and loads without gathering anything.

A sharded parameter (and each optimizer state tensor shaped like it) holds a contiguous range
``[start, end)`` of its flattened full tensor. DCP describes a rank's part of a tensor as boxes
(offsets and sizes in the full shape); a contiguous flat range of a row-major tensor is at most
``2 * ndim - 1`` such boxes, each contiguous in memory. ``LocalShard`` implements DCP's checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) over those
boxes, so each rank writes only its own elements, and a load at any world size (or into a plain
model, whose tensors are whole) reads the overlaps it needs. Under tensor parallelism the range is of
this TP rank's slice (``region``: its offsets and sizes in the full tensor), and the boxes are shifted
into the full tensor by the slice's offsets, so DCP reshards across TP sizes too. Loads write through
the boxes into the storage the shard views: a state dict of ``LocalShard``s loaded by DCP updates the
model in place.

Like a DTensor, it reports the *full* tensor's ``size()``/``shape`` (DCP checks it against the
checkpoint); ``local()`` is this rank's 1-D elements. Ops on it see the local elements and return
plain tensors. It pickles as its plain local tensor, so per-rank ``torch.save`` keeps working.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..base._compat import disabled_torch_function, make_tensor_subclass
from ..job.distributed import current_state

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first flat element


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes covering elements ``[start, end)`` of a row-major tensor of ``shape``, in element order."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    row_a, col_a = divmod(start, inner)
    row_b, col_b = divmod(end, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s), row * inner + first) for o, s, first in flat_range_boxes(shape[1:], lo, hi)]

    if row_a == row_b:
        return in_row(row_a, col_a, col_b)
    boxes: list[Box] = []
    if col_a:
        boxes += in_row(row_a, col_a, inner)
        row_a += 1
    if row_b > row_a:
        boxes.append(((row_a, *[0] * (len(shape) - 1)), (row_b - row_a, *shape[1:]), row_a * inner))
    if col_b:
        boxes += in_row(row_b, 0, col_b)
    return boxes


class LocalShard(torch.Tensor):
    """Elements ``[start, start + numel)`` of a flattened tensor of ``full_shape``, held by this rank."""

    full_shape: torch.Size
    start: int
    region: tuple[tuple[int, ...], tuple[int, ...]]  # offsets and sizes of the slice the range indexes
    _boxes: list[Box]

    # Ops run on the local elements and return plain tensors (no metadata to carry wrongly).
    __torch_function__ = disabled_torch_function

    @classmethod
    def of(cls, local: torch.Tensor, full_shape: tuple[int, ...] | torch.Size, start: int,
           region: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
           boxes: list[Box] | None = None) -> LocalShard:
        """A ``LocalShard`` viewing ``local`` (flattened; no copy) as elements from ``start`` on of the
        flattened ``region`` (offsets, sizes) of the full tensor (default: all of it). ``boxes``: where the
        region is no box of the full tensor (a strided TP split: ``reshard.Piece.boxes``), its boxes, each
        with its first element counted in ``local``."""
        flat = local.detach().reshape(-1)
        full = torch.Size(full_shape)
        origin, sizes = region if region is not None else ((0,) * len(full), tuple(full))
        if start < 0 or start + flat.numel() > math.prod(sizes):
            raise ValueError(f"a local shard of {flat.numel()} elements from {start} does not fit a tensor of "
                             f"shape {tuple(sizes)} ({math.prod(sizes)} elements)")
        shard = make_tensor_subclass(cls, flat, False)
        shard.full_shape = full
        shard.start = start
        shard.region = (tuple(origin), tuple(sizes))
        if full.numel() == 0:
            # Someone must declare an empty tensor, or DCP would not know it exists: rank 0's boxes do.
            shard._boxes = [((0,) * len(full), tuple(full), 0)] if start == 0 and _is_rank0() else []
        elif boxes is not None:
            shard._boxes = [(tuple(o), tuple(b), first + start) for o, b, first in boxes]
        else:
            found = flat_range_boxes(tuple(sizes), start, start + flat.numel())
            shard._boxes = [(tuple(o + a for o, a in zip(offsets, origin, strict=True)), box, first)
                            for offsets, box, first in found]
        return shard

    def local(self) -> torch.Tensor:
        """This rank's elements as a plain 1-D tensor (shares storage)."""
        return self.as_subclass(torch.Tensor)

    def range_mismatch(self, other: LocalShard) -> str | None:
        """Why this shard does not hold the elements ``other`` (this rank's own) does, or None."""
        if (tuple(self.full_shape), self.region, self.start, self.end) == \
                (tuple(other.full_shape), other.region, other.start, other.end):
            return None
        return (f"it holds elements [{self.start}, {self.end}) of the {self.region} region of "
                f"{tuple(self.full_shape)}, this rank's are [{other.start}, {other.end}) of the "
                f"{other.region} region of {tuple(other.full_shape)}: load the checkpoint through "
                "torch.distributed.checkpoint into this model's and optimizer's own state dicts "
                "(get_state_dict, dcp.load, set_state_dict)")

    @property
    def end(self) -> int:
        """One past the last flat element held."""
        return self.start + self.local().numel()

    # ---- the full tensor's metadata, as DTensor reports it ------------------------------------------------
    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        """The full tensor's size (DCP compares it with the checkpoint's)."""
        return self.full_shape if dim is None else self.full_shape[dim]

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        """The full tensor's shape."""
        return self.full_shape

    def __repr__(self, **kwargs: Any) -> str:
        return (f"LocalShard(full_shape={tuple(self.full_shape)}, elements [{self.start}, {self.end}), "
                f"dtype={self.dtype}, device={self.device})")

    def __reduce_ex__(self, protocol: int) -> Any:
        return self.local().clone().__reduce_ex__(protocol)

    # ---- DCP's checkpointable protocol (DCP is imported only by whoever checkpoints with it: it costs ~2 s)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        """One write item per box this rank holds."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self.local())
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets), k), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                                  sizes=torch.Size(sizes)),
                                                      properties=props, size=self.full_shape))
                for k, (offsets, sizes, _) in enumerate(self._boxes)]

    def __create_chunk_list__(self) -> list[Any]:
        """The boxes this rank holds, for DCP's load planner."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """The box at ``index.offset`` as a view of the local elements (DCP reads from it or copies into it)."""
        k = index.index
        if k is None or k >= len(self._boxes) or tuple(self._boxes[k][0]) != tuple(index.offset):
            k = next((i for i, b in enumerate(self._boxes) if tuple(b[0]) == tuple(index.offset)), None)
            if k is None:
                raise ValueError(f"{index.fqn!r}: this rank holds no box at offsets {tuple(index.offset)} "
                                 f"(it holds elements [{self.start}, {self.end}) of {tuple(self.full_shape)})")
        _, sizes, first = self._boxes[k]
        a = first - self.start
        return self.local()[a:a + math.prod(sizes)].view(sizes)


def _is_rank0() -> bool:
    state = current_state()
    return state is None or state.rank == 0
