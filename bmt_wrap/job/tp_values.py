"""Whole values of TP-split parameters: what checkpoints and ``state_dict()`` hold, whatever the layout.

A TP-split parameter's ZeRO value (``full_tensor()``, a dp gather) is this TP rank's slice; files hold
the whole tensor (``_tp_original_shape``), so a checkpoint written at one tensor-parallel size loads at
any other, and in plain PyTorch.
"""

from __future__ import annotations

import torch

from ..runtime.tp_marks import tp_blocks, tp_full_shape, tp_slice, tp_split_dim, tp_split_parts
from ..runtime.tp_ops import gather_tp_slices
from .distributed import parallel_layout


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The shape ``p`` has in a checkpoint: the whole tensor for a TP-split parameter, else ``p.shape``."""
    return tp_full_shape(p)


def whole_value(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (``p``'s value on this TP rank) joined with its TP peers' along the split dimension (a
    strided split: within each block); a collective over the TP group for a TP-split ``p`` (every TP peer
    must call it), else ``local``."""
    dim = tp_split_dim(p)
    layout = parallel_layout()
    if dim is None or layout.tp_size == 1:
        return local
    parts = tp_split_parts(p)
    if parts == 1:
        return gather_tp_slices(local.contiguous(), layout.tp, dim)
    return gather_tp_slices(tp_blocks(local.contiguous(), dim, parts), layout.tp, dim + 1).flatten(dim, dim + 1)


def local_value(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of ``whole`` for a TP-split ``p`` (no communication), else ``whole``."""
    dim = tp_split_dim(p)
    layout = parallel_layout()
    if dim is None or layout.tp_size == 1:
        return whole
    return tp_slice(whole, dim, layout.tp_rank, layout.tp_size, tp_split_parts(p))
