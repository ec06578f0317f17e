"""bmt_wrap: one-line ZeRO-3 sharding, activation checkpointing and prefetch for any torch.nn.Module.

    import bmt_wrap as bmt
    bmt.init_distributed()
    model = bmt.BMTrainModelWrapper(model)
"""

from . import errors, inspect, loss, lr_scheduler, optim, passes
from .apply_plan import is_wrapped
from .block import Block, CheckpointBlock, TransformerBlockList
from .checkpoint import load, load_checkpoint, save, save_checkpoint
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
from .gathered import gathered
from .init import init_parameters
from .inspect import see_memory
from .mixed_precision import MixedPrecision
from .module import DistributedModule
from .plan import WrapPlan
from .runtime.param import DistributedParameter
from .verify import VerifyReport
from .wrapper import BMTrainModelWrapper, wrap

__version__ = "0.1.0"

__all__ = [
    "BMTrainModelWrapper", "Block", "CheckpointBlock", "DistributedModule", "DistributedParameter",
    "MixedPrecision", "TransformerBlockList", "VerifyReport", "WrapPlan", "barrier", "comm_stats", "errors",
    "gathered", "get_state", "init_distributed", "init_parameters", "inspect", "is_initialized", "is_wrapped",
    "load", "load_checkpoint", "local_rank", "loss", "lr_scheduler", "optim", "passes", "print_rank", "rank",
    "reset_comm_stats", "save", "save_checkpoint", "see_memory", "sum_loss", "synchronize", "world_size", "wrap",
]
