"""``DistributedParameter``: the 1-D view of this rank's slice of one original parameter.

Every sharded parameter, whether made by the wrapper, a ``CheckpointBlock`` or by hand, is one of these:
a real ``nn.Parameter`` (so any optimizer and name-based param groups work) viewing this rank's piece
of a flat shard, with ``.fqn`` and ``.full_shape`` describing the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat import make_tensor_subclass
from .process_engine import get_engine

if TYPE_CHECKING:
    from ..plan import ParamSlot
    from .flat_buffer import FlatBuffer
    from .group import ShardGroup


class DistributedParameter(nn.Parameter):
    """A parameter sharded across ranks: holds this rank's 1-D slice of the full tensor.

    ``DistributedParameter(data, requires_grad=True, init_method=None, group=None)`` (BMTrain's
    signature) takes the full tensor, which every rank passes identically, and keeps this rank's slice.
    """

    fqn: str
    full_shape: torch.Size
    _bmt_buffer: FlatBuffer
    _bmt_slot: int
    _init_method: Callable[[torch.Tensor], Any] | None

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True,
                init_method: Callable[[torch.Tensor], Any] | None = None, group: str | None = None
                ) -> DistributedParameter:
        return get_engine().standalone_parameter(data, requires_grad, init_method, group)

    @classmethod
    def _view_of(cls, buffer: FlatBuffer, slot_index: int, view: torch.Tensor, requires_grad: bool,
                 fqn: str, full_shape: torch.Size) -> DistributedParameter:
        p = make_tensor_subclass(cls, view, requires_grad)
        p.fqn = fqn
        p.full_shape = torch.Size(full_shape)
        p._bmt_buffer = buffer
        p._bmt_slot = slot_index
        p._init_method = None
        return p

    # ---- the interface every layer above the runtime uses (never _bmt_buffer / _bmt_slot) -------------
    @property
    def shard_group(self) -> ShardGroup:
        """The shard group this parameter lives in (gathered and reduced together)."""
        return self._bmt_buffer.group

    @property
    def flat_buffer(self) -> FlatBuffer:
        """The flat buffer (one dtype, one requires_grad) of its group that holds this parameter."""
        return self._bmt_buffer

    @property
    def slot_index(self) -> int:
        """Its position in ``flat_buffer`` (the plan's slot order)."""
        return self._bmt_slot

    @property
    def slot_spec(self) -> ParamSlot:
        """Its slot in the plan: name, aliases, shape, offset."""
        return self._bmt_buffer.spec.slots[self._bmt_slot]

    def source_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of the flattened full tensor that this rank's (or rank ``rank``'s) slice holds."""
        return self._bmt_buffer.slot_source_range(self._bmt_slot, rank)

    def load_full(self, full: torch.Tensor) -> None:
        """Keep this rank's part of ``full`` (the whole parameter, identical on every rank); no communication."""
        self._bmt_buffer.load_slot(self._bmt_slot, full)

    def gathered_view(self, full_buffers: list[torch.Tensor]) -> torch.Tensor:
        """This parameter's full value inside its group's gathered buffers (one per flat buffer)."""
        group = self._bmt_buffer.group
        return self._bmt_buffer.slot_views(full_buffers[group.buffers.index(self._bmt_buffer)])[self._bmt_slot]

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """This rank's slice as a plain parameter (BMTrain scripts snapshot parameters so); never in a model.

        A module being deep-copied is already in ``memo`` (copy registers each object before its state):
        a copy of a sharded model would hold slices its engine does not know, so that raises.
        """
        if any(isinstance(v, nn.Module) for v in memo.values()):
            raise TypeError(f"cannot deepcopy a model holding sharded parameter {self.fqn!r}: copy the model "
                            "before wrapping, or use `with bmt.gathered(model):` to read full values")
        copied = nn.Parameter(self.detach().clone(), requires_grad=self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(f"cannot pickle sharded parameter {self.fqn!r} (it is one rank's slice); save "
                        "with bmt.save(model, path) or bmt.save_checkpoint(dir, model)")

    def __repr__(self) -> str:
        return (f"DistributedParameter({self.fqn!r}, full_shape={tuple(self.full_shape)}, "
                f"local={self.numel()} of {self.full_shape.numel()}, dtype={self.dtype})")
