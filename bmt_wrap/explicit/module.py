"""``DistributedModule``: BMTrain's base class for modules that own ``DistributedParameter``s.

Outside any block, reading a ``DistributedParameter`` attribute during forward returns the gathered
full tensor (autograd-aware: its gradient is reduce-scattered in backward); outside forward it is the
local 1-D view, so touching one never communicates and no rank can hang on it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import WrapError
from ..runtime.active_engine import get_engine
from ..runtime.module_params import registrations
from ..runtime.param import DistributedParameter
from ..wrapping.sharded_module import ShardedModuleMixin


class DistributedModule(ShardedModuleMixin, nn.Module):
    """Base class whose own ``DistributedParameter``s are gathered when read during forward."""

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if isinstance(value, DistributedParameter) and value.shard_group.standalone:
            engine = get_engine()
            if engine.in_forward:
                return engine.gathered_standalone(value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = get_engine()
        outermost = not engine.in_forward and not engine.in_block  # a recompute is not a new forward
        if outermost:
            _check_parameters(self, engine.world_size)
            engine.begin_forward(engine.explicit)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if outermost:
                engine.end_forward(engine.explicit)


def _check_parameters(root: nn.Module, world_size: int) -> None:
    """Refuse parameter placements the engine would get silently wrong, naming the parameter."""
    if getattr(root, "_bmt_checked", False):
        return
    for name, module, attr, p in registrations(root):
        if isinstance(p, DistributedParameter):
            group = p.shard_group
            if not group.standalone and not any(m is module and a == attr
                                                for locs in group.locations for slot in locs
                                                for m, a in slot):
                raise WrapError(
                    f"parameter {name!r} belongs to block {group.name!r} ({p.fqn!r}) but is also used "
                    "outside it; a block owns its parameters. Share it through a "
                    "bmt.DistributedParameter outside every block instead.")
        elif p.requires_grad and world_size > 1:
            # Trained replicated with un-averaged gradients: a silent divergence across ranks.
            raise WrapError(
                f"parameter {name!r} is a plain nn.Parameter outside every CheckpointBlock, so its "
                "gradient would not be averaged across ranks. Make it a bmt.DistributedParameter, put "
                "its module inside a CheckpointBlock, or wrap the model with bmt.BMTrainModelWrapper.")
    object.__setattr__(root, "_bmt_checked", True)
