"""bmt_wrap: one-line ZeRO-3 sharding, activation checkpointing and prefetch for any torch.nn.Module."""

from . import errors
from .distributed import (
    barrier,
    comm_stats,
    get_state,
    init_distributed,
    is_initialized,
    local_rank,
    print_rank,
    rank,
    reset_comm_stats,
    sum_loss,
    synchronize,
    world_size,
)

__version__ = "0.1.0"

__all__ = [
    "barrier", "comm_stats", "errors", "get_state", "init_distributed", "is_initialized", "local_rank",
    "print_rank", "rank", "reset_comm_stats", "sum_loss", "synchronize", "world_size",
]
