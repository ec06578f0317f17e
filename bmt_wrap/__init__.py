"""bmt_wrap: one-line ZeRO-3 sharding, activation checkpointing and prefetch for any torch.nn.Module.

    import bmt_wrap as bmt
    bmt.init_distributed()
    model = bmt.BMTrainModelWrapper(model)
"""

# BMTrain's module paths are importable here too; ``distributed`` is the module holding init_distributed
# and the differentiable collectives.
from . import (
    block_layer,
    distributed,
    errors,
    global_var,
    inspect,
    loss,
    lr_scheduler,
    nccl,
    nn,
    optim,
    passes,
    pipe_layer,
    store,
    utils,
)
from .apply_plan import is_wrapped
from .block import Block, CheckpointBlock, PipelineTransformerBlockList, TransformerBlockList
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
    shutdown,
    sum_loss,
    world_size,
)
from .gathered import gathered
from .global_var import config
from .init import init_parameters
from .inspect import see_memory
from .mixed_precision import MixedPrecision
from .module import DistributedModule
from .plan import WrapPlan
from .runtime.param import DistributedParameter
from .synchronize import gather_result, synchronize, wait_loader  # the module's name now means the function
from .verify import VerifyReport
from .wrapper import BMTrainModelWrapper, wrap

__version__ = "0.1.0"

__all__ = [
    "BMTrainModelWrapper", "Block", "CheckpointBlock", "DistributedModule", "DistributedParameter",
    "MixedPrecision", "PipelineTransformerBlockList", "TransformerBlockList", "VerifyReport", "WrapPlan", "barrier",
    "block_layer", "comm_stats", "config", "distributed", "errors", "gather_result", "gathered", "get_state",
    "global_var", "init_distributed", "init_parameters", "inspect", "is_initialized", "is_wrapped", "load",
    "load_checkpoint", "local_rank", "loss", "lr_scheduler", "nccl", "nn", "optim", "passes", "pipe_layer",
    "print_rank", "rank", "reset_comm_stats", "save", "save_checkpoint", "see_memory", "shutdown", "store", "sum_loss",
    "synchronize", "utils", "wait_loader", "world_size", "wrap",
]
