"""``DistributedModule``: BMTrain's base class for modules that own ``DistributedParameter``s.

Outside any block, reading a ``DistributedParameter`` attribute during forward returns the gathered
full tensor (autograd-aware: its gradient is reduce-scattered in backward); outside forward it is the
local 1-D view, so touching one never communicates and no rank can hang on it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .errors import WrapError
from .runtime.engine import get_engine
from .runtime.param import DistributedParameter
from .sharded_module import ShardedModuleMixin


class DistributedModule(ShardedModuleMixin, nn.Module):
    """Base class whose own ``DistributedParameter``s are gathered when read during forward."""

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if isinstance(value, DistributedParameter) and value._bmt_buffer.group.standalone:
            engine = get_engine()
            if engine.in_forward:
                return engine.gathered_standalone(value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = get_engine()
        outermost = not engine.in_forward
        if outermost:
            _check_plain_parameters(self, engine.world_size)
            engine.begin_forward()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if outermost:
                engine.end_forward()


def _check_plain_parameters(root: nn.Module, world_size: int) -> None:
    # A plain trainable parameter outside every block would train replicated with un-averaged gradients:
    # a silent divergence across ranks. Refuse it, naming it.
    if world_size == 1 or getattr(root, "_bmt_plain_checked", False):
        return
    for name, p in root.named_parameters():
        if p.requires_grad and not isinstance(p, DistributedParameter):
            raise WrapError(f"parameter {name!r} is a plain nn.Parameter outside every CheckpointBlock, so its "
                            "gradient would not be averaged across ranks. Make it a bmt.DistributedParameter, "
                            "put its module inside a CheckpointBlock, or wrap the model with "
                            "bmt.BMTrainModelWrapper.")
    object.__setattr__(root, "_bmt_plain_checked", True)
