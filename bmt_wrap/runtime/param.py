"""``DistributedParameter``: a parameter of the original's shape whose elements are spread over the ranks.

Every sharded parameter, whether made by the wrapper, a ``CheckpointBlock`` or by hand, is one of these:
an ``nn.Parameter`` and a ``ShardedTensor`` (global ``shape``, this rank's range as ``to_local()``, a
view into its group's flat shard), so optimizers, ``clip_grad_norm_`` and name- or shape-based param
groups behave as on the unwrapped model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..base._compat import register_foreach_type
from ..base.plan import ParamSlot
from ..errors import NOT_INITIALIZED, NotInitializedError
from .comm import Communicator
from .sharded_tensor import ShardedTensor, ShardLayout, ShardStorage


class ParamGroup(Protocol):
    """The shard group a parameter belongs to, as the parameter uses it (``group.ShardGroup``, a layer up)."""

    name: str
    comm: Communicator
    replicas: Communicator | None
    buffers: Sequence[ParamBuffer]

    def gather_values(self, only: Any = None) -> list[torch.Tensor]:
        """Full buffers in the shard dtype (a collective)."""


class ParamBuffer(ShardStorage, Protocol):
    """The flat buffer a parameter's range lives in, as the parameter uses it (``flat_buffer.FlatBuffer``)."""

    group: ParamGroup
    shard: torch.Tensor

    def load_slot(self, i: int, full: torch.Tensor) -> None:
        """Keep this rank's part of slot ``i``'s full tensor."""

    def slot_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's full-shaped view of a gathered buffer."""


# BMTrain's ``DistributedParameter(data)`` shards ``data`` into a group of its own, which only the engine
# can build; the engine layer installs how (active_engine.install_engine), so this module never reaches up.
_standalone: Callable[..., DistributedParameter] | None = None


def install_standalone(build: Callable[..., DistributedParameter] | None) -> None:
    """Make ``build(data, requires_grad, init_method, group, tp_mode, tp_split_dim)`` what
    ``DistributedParameter(...)`` calls."""
    global _standalone
    _standalone = build


class DistributedParameter(ShardedTensor, nn.Parameter):
    """A parameter sharded across ranks: the full tensor's shape, this rank's range of its elements.

    ``DistributedParameter(data, requires_grad=True, init_method=None, group=None, tp_mode=False,
    tp_split_dim=-1)`` (BMTrain's signature) takes the full tensor, which every rank passes identically,
    and keeps this rank's range. With ``tp_mode``, ``data`` is this TP rank's slice along ``tp_split_dim``
    (-1: every TP peer holds it whole), sharded over the data-parallel group (``tp_marks.py``).
    """

    fqn: str
    _init_method: Callable[[torch.Tensor], Any] | None

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True,
                init_method: Callable[[torch.Tensor], Any] | None = None, group: str | None = None,
                tp_mode: bool = False, tp_split_dim: int = -1) -> DistributedParameter:
        if _standalone is None:
            raise NotInitializedError(NOT_INITIALIZED)
        return _standalone(data, requires_grad, init_method, group, tp_mode, tp_split_dim)

    @classmethod
    def _view_of(cls, buffer: ParamBuffer, slot_index: int, view: torch.Tensor, requires_grad: bool
                 ) -> DistributedParameter:
        layout = ShardLayout(buffer, slot_index)
        p = ShardedTensor._wrap(cls, view, layout, requires_grad)
        p.fqn = layout.name
        p._init_method = None
        return p

    # ---- the interface every layer above the runtime uses ---------------------------------------------
    @property
    def full_shape(self) -> torch.Size:
        """The original parameter's shape (``self.shape``; kept for code written for flat parameters)."""
        return self._layout.full_shape

    @property
    def shard_group(self) -> ParamGroup:
        """The shard group this parameter lives in (gathered and reduced together)."""
        return self._layout.buffer.group

    @property
    def flat_buffer(self) -> ParamBuffer:
        """The flat buffer (one dtype, one requires_grad) of its group that holds this parameter."""
        return self._layout.buffer

    @property
    def slot_index(self) -> int:
        """Its position in ``flat_buffer`` (the plan's slot order)."""
        return self._layout.slot

    @property
    def slot_spec(self) -> ParamSlot:
        """Its slot in the plan: name, aliases, shape, offset."""
        return self._layout.buffer.spec.slots[self._layout.slot]

    def source_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of the flattened full tensor that this rank's (or rank ``rank``'s) range holds."""
        return self._layout.buffer.slot_source_range(self._layout.slot, rank)

    def load_full(self, full: torch.Tensor) -> None:
        """Keep this rank's part of ``full`` (the whole parameter, identical on every rank); no communication."""
        self._layout.buffer.load_slot(self._layout.slot, full)

    def gathered_view(self, full_buffers: list[torch.Tensor]) -> torch.Tensor:
        """This parameter's full value inside its group's gathered buffers (one per flat buffer)."""
        buffer = self._layout.buffer
        return buffer.slot_views(full_buffers[buffer.group.buffers.index(buffer)])[self._layout.slot]

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter, gathered from every rank (a collective: call it on every rank)."""
        buffer = self._layout.buffer
        if buffer.shard.is_meta:
            return torch.empty(self.full_shape, dtype=self.dtype, device="meta")
        # Its own flat buffer only: under pipeline parallelism a stage's groups hold other buffers than the
        # ghosts other stages hold of them, but each buffer is the same everywhere.
        full = buffer.group.gather_values(only=buffer)[0]
        return buffer.slot_views(full)[self._layout.slot].clone()  # frees the rest

    def __deepcopy__(self, memo: dict) -> ShardedTensor:
        """A copy of this rank's range with the same layout (BMTrain scripts snapshot parameters so); never
        in a model.

        A module being deep-copied is already in ``memo`` (copy registers each object before its state):
        a copy of a sharded model would hold ranges its engine does not know, so that raises.
        """
        if any(isinstance(v, nn.Module) for v in memo.values()):
            raise TypeError(f"cannot deepcopy a model holding sharded parameter {self.fqn!r}: copy the model "
                            "before wrapping, or use `with bmt.gathered(model):` to read full values")
        copied = ShardedTensor.wrap(self._local.detach().clone(), self._layout)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(f"cannot pickle sharded parameter {self.fqn!r} (it is one rank's range); save "
                        "with bmt.save(model, path) or bmt.save_checkpoint(dir, model)")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        start, end = self._layout.start, self._layout.end
        return (f"DistributedParameter({self.fqn!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"local elements [{start}, {end}) of {self.numel()})")


register_foreach_type(DistributedParameter)

_REPLACED_BY = "_bmt_replaced_by"


def mark_replaced(original: torch.Tensor, successor: DistributedParameter) -> None:
    """Record that wrapping put ``successor`` where ``original`` was (optimizers built before follow it)."""
    setattr(original, _REPLACED_BY, successor)


def replaced_by(p: torch.Tensor) -> DistributedParameter | None:
    """The sharded parameter that replaced ``p`` when its model was wrapped, or None."""
    return getattr(p, _REPLACED_BY, None)
