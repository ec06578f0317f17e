"""One-parameter groups: what ``DistributedParameter(data)`` builds outside any block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..base.dtypes import dtype_name
from ..base.plan import ParamInfo, ShardGroupSpec, layout_buffers
from ..errors import WrapError
from .group import ShardGroup
from .module_params import Location
from .param import DistributedParameter
from .tp_marks import mark_tp


class GroupBuilder(Protocol):
    """What sharding a bare parameter needs from the engine (engine.py, the layer above)."""

    def build_group(self, spec: ShardGroupSpec, locations: list[list[list[Location]]],
                    sources: list[list[torch.Tensor | None]], device: torch.device | str,
                    sync_from: int | None = 0, used_outside_blocks: bool = False) -> ShardGroup:
        """Shard ``sources`` into a new group of the explicit API's runtime."""

_COUNTER = [0]


def shard_standalone(engine: GroupBuilder, data: torch.Tensor, requires_grad: bool = True,
                     init_method: Callable[[torch.Tensor], Any] | None = None,
                     group: str | None = None, tp_mode: bool = False, tp_split_dim: int = -1,
                     tp_size: int = 1) -> DistributedParameter:
    """Shard ``data`` (identical on every rank; with ``tp_mode`` this TP rank's slice, identical across the
    data-parallel group) into a group of its own; returns the sharded parameter."""
    if not isinstance(data, torch.Tensor):
        raise WrapError(f"DistributedParameter expects a tensor, got {type(data).__name__}")
    if isinstance(data, DistributedParameter):
        raise WrapError(f"{data.fqn!r} is already a DistributedParameter")
    if tp_mode and tp_split_dim >= data.dim():
        raise WrapError(f"DistributedParameter(tp_split_dim={tp_split_dim}) on a tensor of shape "
                        f"{tuple(data.shape)}: the split dimension must be one of its dimensions (or -1)")
    _COUNTER[0] += 1
    name = f"param{_COUNTER[0]}"
    info = ParamInfo(fqn=name, shape=list(data.shape), dtype=dtype_name(data.dtype),
                     requires_grad=requires_grad)
    spec = ShardGroupSpec(name=name, buffers=layout_buffers([info]), checkpoint=False, zero_level=3)
    source = data.detach()
    if tp_mode:
        mark_tp(source, tp_split_dim, tp_size)  # a fresh alias of data: the marks reach the new parameter
    g = engine.build_group(spec, [[[]]], [[source]], data.device, sync_from=0, used_outside_blocks=True)
    g.standalone = True
    p = g.buffers[0].params[0]
    p._init_method = init_method
    p.bmt_group_name = group
    return p


def full_value(p: nn.Parameter) -> torch.Tensor:
    """The full value of a parameter: gathered (collective) for a sharded one, detached otherwise."""
    if not isinstance(p, DistributedParameter):
        return p.detach()
    return p.full_tensor()
