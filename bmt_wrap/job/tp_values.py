"""Whole values of TP-split parameters (and of expert parameters under expert parallelism): what
checkpoints and ``state_dict()`` hold, whatever the layout.

A TP-split parameter's ZeRO value (``full_tensor()``, a dp gather) is this TP rank's slice; files hold
the whole tensor (``_tp_original_shape``), so a checkpoint written at one tensor-parallel size loads at
any other, and in plain PyTorch.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..runtime.tp_marks import tp_blocks, tp_full_shape, tp_slice, tp_split_dim, tp_split_parts
from ..runtime.tp_ops import gather_tp_slices
from .distributed import parallel_layout


def expert_split(p: torch.Tensor) -> bool:
    """True for an expert parameter under expert parallelism: it holds this EP rank's experts (dim 0), in a
    buffer sharded over their owners (``FlatBufferSpec.ep_split``)."""
    buffer = getattr(getattr(p, "_layout", None), "buffer", None)
    return buffer is not None and bool(buffer.spec.ep_split)


def list_expert(p: torch.Tensor) -> bool:
    """True for a parameter of an expert held in a ModuleList under expert parallelism: whole on its EP
    rank alone, under its own name (``wrapping/experts.py``)."""
    return bool(getattr(p, "_bmt_list_expert", False))


def _refuse_list_expert(p: torch.Tensor) -> None:
    """A whole state would need every EP rank's expert names gathered, which is not built."""
    if list_expert(p):
        raise UnsupportedError("reading or loading whole values of experts held as a ModuleList under ep_size= "
                               "(state_dict, bmt.save/load, init_parameters) is not built yet: each EP rank "
                               "holds its own experts' parameters, under their names (model.named_parameters())")


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The shape ``p`` has in a checkpoint: the whole tensor for a TP-split parameter or an expert
    parameter under expert parallelism (every EP rank's experts), else ``p.shape``."""
    _refuse_list_expert(p)
    if expert_split(p):
        return torch.Size([p.shape[0] * parallel_layout().ep_size, *p.shape[1:]])
    return tp_full_shape(p)


def whole_value(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (``p``'s value on this TP rank) joined with its TP peers' along the split dimension (a
    strided split: within each block); a collective over the TP group for a TP-split ``p`` (every TP peer
    must call it), else ``local``."""
    dim = tp_split_dim(p)
    layout = parallel_layout()
    _refuse_list_expert(p)
    if expert_split(p):  # every EP rank's experts, in rank order (a collective over the EP group)
        assert layout.ep is not None
        return gather_tp_slices(local.contiguous(), layout.ep, 0)
    if dim is None or layout.tp_size == 1:
        return local
    parts = tp_split_parts(p)
    if parts == 1:
        return gather_tp_slices(local.contiguous(), layout.tp, dim)
    return gather_tp_slices(tp_blocks(local.contiguous(), dim, parts), layout.tp, dim + 1).flatten(dim, dim + 1)


def local_value(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of ``whole`` for a TP-split ``p``, this EP rank's experts of it for an expert
    parameter under expert parallelism (no communication), else ``whole``."""
    dim = tp_split_dim(p)
    layout = parallel_layout()
    _refuse_list_expert(p)
    if expert_split(p):
        return whole.chunk(layout.ep_size)[layout.ep_rank]
    if dim is None or layout.tp_size == 1:
        return whole
    return tp_slice(whole, dim, layout.tp_rank, layout.tp_size, tp_split_parts(p))
