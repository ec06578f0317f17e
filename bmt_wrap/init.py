"""``init_parameters``: run each sharded parameter's ``init_method`` on its full tensor, keep this rank's slice."""

from __future__ import annotations

import torch
from torch import nn

from .runtime.param import DistributedParameter


@torch.no_grad()
def init_parameters(model: nn.Module) -> None:
    """Initialise every ``DistributedParameter`` that has an ``init_method``, one full tensor at a time.

    Every rank draws the same random numbers (``init_distributed`` seeds all ranks alike), so each keeps
    its slice of identical full tensors; peak extra memory is the largest single parameter.
    """
    for p in model.parameters():
        if isinstance(p, DistributedParameter) and p._init_method is not None:
            buffer = p._bmt_buffer
            device = buffer.shard.device if not buffer.shard.is_meta else torch.device("cpu")
            full = torch.empty(p.full_shape, dtype=p.dtype, device=device)
            p._init_method(full)
            buffer.load_slot(p._bmt_slot, full)
