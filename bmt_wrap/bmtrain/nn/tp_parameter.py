"""This TP rank's slice of a parameter drawn whole: how the tensor-parallel layers make their weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import TPShapeError
from ...job.distributed import get_state, parallel_layout
from ...runtime.param import DistributedParameter


def split_size(total: int, what: str) -> int:
    """``total`` divided by the tensor-parallel size; ``TPShapeError`` (on every rank) unless it divides."""
    tp_size = parallel_layout().tp_size
    if total % tp_size:
        raise TPShapeError(f"{what}={total} is not divisible by the tensor-parallel size {tp_size}: choose sizes "
                           f"that divide by tp_size, or a tp_size that divides {total}")
    return total // tp_size


def tp_parameter(shape: tuple[int, ...], split_dim: int, init_method: Callable[[torch.Tensor], Any],
                 dtype: torch.dtype | None) -> DistributedParameter:
    """A ``DistributedParameter`` holding this TP rank's slice (along ``split_dim``, -1: whole) of a
    ``shape`` tensor drawn with ``init_method`` identically on every rank, so the model equals one built
    whole under the same seed (as ``bmt.init_parameters`` draws it again: BMTrain's rule)."""
    layout = parallel_layout()
    whole = torch.empty(shape, dtype=dtype, device=get_state().device)
    init_method(whole)
    local = whole if split_dim < 0 else whole.chunk(layout.tp_size, dim=split_dim)[layout.tp_rank].clone()
    return DistributedParameter(local, init_method=init_method, tp_mode=True, tp_split_dim=split_dim)
