"""Whole values of TP-split parameters (and of expert parameters under expert parallelism): what
checkpoints and ``state_dict()`` hold, whatever the layout.

A TP-split parameter's ZeRO value (``full_tensor()``, a dp gather) is this TP rank's slice; files hold
the whole tensor (``_tp_original_shape``), so a checkpoint written at one tensor-parallel size loads at
any other, and in plain PyTorch.
"""

from __future__ import annotations

import torch

from ..runtime.tp_marks import tp_blocks, tp_full_shape, tp_slice, tp_split_dim, tp_split_parts
from ..runtime.tp_ops import gather_tp_slices
from .distributed import parallel_layout


def expert_split(p: torch.Tensor) -> bool:
    """True for a packed expert parameter under expert parallelism: it holds this EP rank's experts (dim 0),
    in a buffer sharded over their owners (``FlatBufferSpec.ep_split``)."""
    buffer = getattr(getattr(p, "_layout", None), "buffer", None)
    return buffer is not None and bool(buffer.spec.ep_split) and not list_expert(p)


def list_expert(p: torch.Tensor) -> bool:
    """True for a parameter of an expert held in a ModuleList under expert parallelism: whole on its owners
    alone, under its own name (``wrapping/experts.py``)."""
    return getattr(p, "_bmt_list_expert", None) is not None


def list_expert_names(p: torch.Tensor, key: str) -> list[str]:
    """The names, by EP rank, of the parameter each EP rank holds where this rank holds list expert ``p``
    under ``key``: the same position among each rank's own experts (``every_ep_rank`` joins them)."""
    own, per, suffix = p._bmt_list_expert
    base = key[:len(key) - len(f"{own}.{suffix}")]
    return [f"{base}{r * per + own % per}.{suffix}" for r in range(parallel_layout().ep_size)]


def every_ep_rank(local: torch.Tensor) -> torch.Tensor:
    """``local`` stacked with each EP peer's tensor of the same shape, in EP rank order; a collective over the
    EP group (every EP peer must call it)."""
    layout = parallel_layout()
    assert layout.ep is not None
    return gather_tp_slices(local.detach().contiguous().unsqueeze(0), layout.ep, 0)


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The shape ``p`` has in a checkpoint: the whole tensor for a TP-split parameter or an expert
    parameter under expert parallelism (every EP rank's experts), else ``p.shape``."""
    if expert_split(p):
        return torch.Size([p.shape[0] * parallel_layout().ep_size, *p.shape[1:]])
    return tp_full_shape(p)


def whole_value(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (``p``'s value on this TP rank) joined with its TP peers' along the split dimension (a
    strided split: within each block); a collective over the TP group for a TP-split ``p`` (every TP peer
    must call it), else ``local``."""
    dim = tp_split_dim(p)
    layout = parallel_layout()
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
    if expert_split(p):
        return whole.chunk(layout.ep_size)[layout.ep_rank]
    if dim is None or layout.tp_size == 1:
        return whole
    return tp_slice(whole, dim, layout.tp_rank, layout.tp_size, tp_split_parts(p))
