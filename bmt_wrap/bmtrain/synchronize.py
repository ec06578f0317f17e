"""BMTrain's ``bmtrain.synchronize`` module: barriers and small gathers for scripts."""

from __future__ import annotations

import torch

from ..job.collectives import gather_flat
from ..job.distributed import get_state, sum_loss, synchronize

__all__ = ["gather_result", "sum_loss", "synchronize", "wait_loader"]


def gather_result(result: torch.Tensor) -> torch.Tensor:
    """Every rank's ``result`` concatenated along dimension 0 (same shape on every rank); a collective."""
    state = get_state()
    stacked = gather_flat(result.to(state.device), state.comm)
    return stacked.flatten(0, 1).to(result.device)


def wait_loader() -> None:
    """Nothing to wait for: bmt_wrap loads parameters on no side stream of its own."""
