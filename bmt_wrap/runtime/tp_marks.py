"""Which parameters tensor parallelism splits: BMTrain's marks on a parameter, and the slicing they imply.

A TP-split parameter holds one slice of a larger tensor on each of the T ranks of its TP group, cut
along ``_tp_split_dim``; ``shape`` is the slice's (as in BMTrain), ``_tp_original_shape`` the whole
tensor's. ``_tp_split_parts`` (default 1) > 1 says the split dimension holds that many equal blocks
(a fused q/k/v: GPT-2's ``c_attn``), each cut over the TP group, so a rank holds its slice of every block,
concatenated (Megatron's strided split); ``tp_slice`` and ``tp_blocks`` are the one place that layout is
computed. ``_tp_mode`` with ``_tp_split_dim = -1`` (BMTrain's mark for RowParallelLinear's bias) is a
parameter every TP peer holds whole and computes the same gradient for. The marks are plain attributes,
set before ZeRO wrapping by whoever slices (the explicit layers, the one-liner's pass) and carried to the
sharded parameter, so save, load, norms and ``init_parameters`` read one convention.

``_tp_sequence_part`` marks a whole parameter the one-liner's sequence parallelism uses on this TP rank's
part of the sequence (a norm between the parallel linears): its gradient is a part, summed over the TP group.
"""

from __future__ import annotations

import torch

TP_MODE = "_tp_mode"
TP_SPLIT_DIM = "_tp_split_dim"
TP_ORIGINAL_SHAPE = "_tp_original_shape"
TP_SPLIT_PARTS = "_tp_split_parts"
TP_SEQUENCE_PART = "_tp_sequence_part"
_MARKS = (TP_MODE, TP_SPLIT_DIM, TP_ORIGINAL_SHAPE, TP_SPLIT_PARTS)


def mark_tp(p: torch.Tensor, split_dim: int, tp_size: int, parts: int = 1) -> None:
    """Mark ``p`` (this rank's slice) as TP-split along ``split_dim`` over ``tp_size`` ranks (``parts``
    blocks along it, each cut: ``tp_slice``); ``split_dim`` -1: held whole by every TP peer, with the same
    gradient on each (BMTrain's convention)."""
    full = list(p.shape)
    if split_dim >= 0:
        full[split_dim] *= tp_size
    setattr(p, TP_MODE, True)
    setattr(p, TP_SPLIT_DIM, int(split_dim))
    setattr(p, TP_ORIGINAL_SHAPE, torch.Size(full))
    setattr(p, TP_SPLIT_PARTS, int(parts))


def tp_split_dim(p: torch.Tensor) -> int | None:
    """The dimension ``p`` is split along across its TP group, or None when every TP peer holds it whole."""
    if not getattr(p, TP_MODE, False):
        return None
    dim = getattr(p, TP_SPLIT_DIM, -1)
    return dim if dim >= 0 else None


def tp_split_parts(p: torch.Tensor) -> int:
    """How many equal blocks ``p``'s split dimension holds, each cut over the TP group (1: one contiguous cut)."""
    return int(getattr(p, TP_SPLIT_PARTS, 1))


def tp_identical(p: torch.Tensor) -> bool:
    """True for a parameter marked as held whole by every TP peer with the same gradient (``tp_mode``,
    split dim -1); False for a split one and for an unmarked one."""
    return bool(getattr(p, TP_MODE, False)) and tp_split_dim(p) is None


def tp_full_shape(p: torch.Tensor) -> torch.Size:
    """The whole tensor's shape: ``_tp_original_shape`` for a TP-split parameter, else its own shape."""
    return torch.Size(getattr(p, TP_ORIGINAL_SHAPE)) if tp_split_dim(p) is not None else p.shape


def mark_sequence_part(p: torch.Tensor) -> None:
    """Mark whole parameter ``p`` as used on this TP rank's part of the sequence (its gradient is a part)."""
    setattr(p, TP_SEQUENCE_PART, True)


def sequence_part(p: torch.Tensor) -> bool:
    """True for a parameter marked by ``mark_sequence_part``."""
    return bool(getattr(p, TP_SEQUENCE_PART, False))


def copy_tp_marks(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` (the sharded parameter that replaces ``src``) ``src``'s marks, if it has any."""
    if getattr(src, TP_MODE, False):
        for name in _MARKS:
            setattr(dst, name, getattr(src, name))
    if sequence_part(src):
        mark_sequence_part(dst)


def tp_blocks(t: torch.Tensor, dim: int, parts: int = 1) -> torch.Tensor:
    """``t`` with dimension ``dim`` viewed as ``(parts, -1)``: in that view a strided split is a plain cut
    along ``dim + 1`` (a whole tensor and every rank's slice alike; row-major order is unchanged)."""
    return t.unflatten(dim, (parts, -1))


def tp_slice(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, parts: int = 1) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of ``full`` along ``dim`` (equal slices, as the layers cut them); with
    ``parts`` > 1, its slice of each of the ``parts`` blocks along ``dim``, concatenated."""
    if parts == 1:
        return full.chunk(tp_size, dim=dim)[tp_rank]
    return tp_blocks(full, dim, parts).chunk(tp_size, dim=dim + 1)[tp_rank].flatten(dim, dim + 1)
