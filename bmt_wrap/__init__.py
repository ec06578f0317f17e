"""bmt_wrap: one-line ZeRO-3 sharding, activation checkpointing and prefetch for any torch.nn.Module.

    import bmt_wrap as bmt
    bmt.init_distributed()
    model = bmt.BMTrainModelWrapper(model)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from . import _aliases

# The old module paths (BMTrain's ``bmt_wrap.store``, ``bmt_wrap.nccl`` ..., and ``bmt_wrap.plan``,
# ``bmt_wrap.checkpoint`` ...) import the modules at their new homes.
_aliases.install()

# Names load on first use (PEP 562), so ``import bmt_wrap.plan`` or ``bmt_wrap.passes`` (the CLI's
# planning, a notebook reading a plan) loads no runtime. BMTrain's module paths are importable here too;
# ``distributed`` is the module holding init_distributed and the differentiable collectives.
_SUBMODULES = frozenset({
    "block_layer", "distributed", "errors", "global_var", "inspect", "loss", "lr_scheduler", "nccl", "nn",
    "optim", "passes", "pipe_layer", "store", "utils",
})
_FROM = {
    "base.mixed_precision": ["MixedPrecision"],
    "base.plan": ["WrapPlan"],
    "bmtrain.global_var": ["config"],
    "bmtrain.inspect": ["see_memory"],
    # ``bmt.synchronize`` is the function, as in BMTrain, not the module of that name.
    "bmtrain.synchronize": ["gather_result", "synchronize", "wait_loader"],
    "explicit.block": ["Block", "CheckpointBlock", "TransformerBlockList"],
    "explicit.pipeline": ["PipelineTransformerBlockList"],
    "explicit.module": ["DistributedModule"],
    "job.distributed": ["barrier", "comm_stats", "data_parallel_rank", "data_parallel_size", "get_state",
                        "init_distributed", "is_initialized", "local_rank", "parallel_layout", "print_rank", "rank",
                        "reset_comm_stats", "shutdown", "sum_loss", "tensor_parallel", "world_size"],
    "job.tp_inputs": ["check_tp_inputs_agree"],
    "runtime.param": ["DistributedParameter"],
    "save_load": ["consolidated_optimizer_state", "consolidated_state_dict", "load", "load_checkpoint",
                  "save", "save_checkpoint"],
    "save_load.pretrained": ["from_pretrained"],
    "wrapping.apply_plan": ["is_wrapped"],
    "wrapping.gathered": ["gathered"],
    "wrapping.init": ["init_parameters"],
    "wrapping.verify": ["VerifyReport"],
    "wrapping.wrapper": ["BMTrainModelWrapper", "wrap"],
}
_WHERE = {name: module for module, names in _FROM.items() for name in names}


def __getattr__(name: str) -> Any:
    """Load a public name (or BMTrain-path submodule) on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name in _SUBMODULES or f"{__name__}.{name}" in _aliases.MOVED:  # old paths: bmt.checkpoint ...
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'bmt_wrap' has no attribute {name!r}")
    globals()[name] = value  # after the import, which set the submodule of the same name (synchronize)
    return value


# Functions named like the module that defines them (``bmt.gathered``, BMTrain's ``bmt.synchronize``).
_SHADOWED = frozenset(name for name, module in _WHERE.items() if name == module.rsplit(".", 1)[-1])


class _Package(types.ModuleType):
    """The package module: loading a submodule must not replace the function of the same name (Python
    sets a package attribute for each submodule it loads)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    """Public names, loaded or not."""
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "BMTrainModelWrapper", "Block", "CheckpointBlock", "DistributedModule", "DistributedParameter",
    "MixedPrecision", "PipelineTransformerBlockList", "TransformerBlockList", "VerifyReport", "WrapPlan", "barrier",
    "block_layer", "check_tp_inputs_agree", "comm_stats", "config", "consolidated_optimizer_state",
    "consolidated_state_dict", "data_parallel_rank", "data_parallel_size", "distributed", "errors",
    "from_pretrained",
    "gather_result", "gathered", "get_state",
    "global_var", "init_distributed", "init_parameters", "inspect", "is_initialized", "is_wrapped", "load",
    "load_checkpoint", "local_rank", "loss", "lr_scheduler", "nccl", "nn", "optim", "parallel_layout", "passes",
    "pipe_layer",
    "print_rank", "rank", "reset_comm_stats", "save", "save_checkpoint", "see_memory", "shutdown", "store", "sum_loss",
    "synchronize", "tensor_parallel", "utils", "wait_loader", "world_size", "wrap",
]
