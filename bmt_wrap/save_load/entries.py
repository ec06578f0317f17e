"""What a checkpoint holds for a model: one entry per tensor of its ``state_dict``, tied aliases merged.

Found from ``model.state_dict(keep_vars=True)``, which never communicates (sharded parameters come back
as themselves), so keys, their order and any state-dict hooks are exactly plain torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CheckpointError
from ..job.distributed import parallel_layout
from ..job.tp_values import (
    every_ep_rank,
    expert_split,
    list_expert,
    list_expert_names,
    local_value,
    whole_shape,
)
from ..runtime.flat_buffer import FlatBuffer
from ..runtime.param import DistributedParameter
from ..runtime.tp_marks import tp_split_dim
from .formats import TensorSpec
from .optim_shards import param_piece
from .reshard import Piece, whole


@dataclass
class Entry:
    """One tensor of the model under every ``state_dict`` key that holds it (canonical name first)."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: DistributedParameter | None = None  # sharded: this rank's slice
    value: torch.Tensor | None = None  # replicated: every rank holds the whole tensor
    # TP-split (job/tp_values.py): ``shape`` is the whole tensor's, the parameter holds this TP rank's slice
    tp_split: bool = False
    # An expert of a ModuleList under EP: the names of the same position among each EP rank's own experts
    # (job/tp_values.list_expert_names), which whole-state files hold beside this rank's
    ep_names: list[str] | None = None
    absent: bool = False  # another EP rank's list expert (``with_peers``): named and shaped here, held there

    @property
    def name(self) -> str:
        """The canonical name."""
        return self.names[0]

    @property
    def buffer(self) -> FlatBuffer | None:
        """The flat buffer of a sharded entry."""
        return self.param.flat_buffer if self.param is not None else None

    @property
    def over_tp(self) -> bool:
        """A parameter every TP peer holds whole, sharded over shard x tp ranks (each its own range)."""
        return self.param is not None and self.param.flat_buffer.spec.over_tp

    @property
    def file_names(self) -> list[str]:
        """The names a whole-state file holds for this entry: its aliases, or each EP rank's list expert."""
        return self.ep_names or self.names

    def specs(self) -> list[TensorSpec]:
        """One file tensor per name: aliases are written as plain torch writes them, each in full."""
        return [TensorSpec(n, self.dtype, self.shape) for n in self.file_names]

    def file_values(self, whole: torch.Tensor) -> list[tuple[list[str], torch.Tensor]]:
        """(names, tensor) pairs a whole-state file holds, from this rank's ``whole`` value: a list expert's
        every EP rank's (a collective over the EP group), else ``whole`` under every alias."""
        if self.ep_names is None:
            return [(self.names, whole.view(self.shape))]
        return [([n], v) for n, v in zip(self.ep_names, every_ep_rank(whole.view(self.shape)), strict=True)]

    def local(self) -> torch.Tensor:
        """This rank's part, flattened: the slice of a sharded entry, the whole of a replicated one."""
        if self.param is not None:
            return self.param.to_local().detach()
        assert self.value is not None
        return self.value.detach().reshape(-1)

    def local_range(self) -> tuple[int, int]:
        """``[start, end)`` of the flattened full tensor that ``local()`` holds (TP-split: of the whole)."""
        if self.tp_split:
            return 0, self.numel
        if self.param is not None:
            return self.param.source_range()
        return 0, self.numel

    def piece(self) -> Piece:
        """Where ``local()`` sits in the whole tensor: this TP rank's slice (an expert parameter: this EP rank's
        experts) and this rank's range of it."""
        if self.param is None:
            return whole(self.shape)
        return param_piece(self.param, *self.param.source_range())

    @property
    def expert(self) -> bool:
        """An expert parameter under expert parallelism: ``piece()`` cuts its experts (dim 0) by EP rank."""
        return self.param is not None and expert_split(self.param)

    @torch.no_grad()
    def set_local(self, flat: torch.Tensor) -> None:
        """Set ``local()`` from ``flat`` (``piece()``'s elements)."""
        if self.param is not None:
            self.param.to_local().copy_(flat)
        else:
            self.assign(flat)

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)

    def destination(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The storage this rank's part lives in, when values of ``dtype`` can be read straight into it
        (a materialised shard of that dtype); else None, and ``assign`` takes a copy."""
        if self.param is None or self.dtype != dtype or self.tp_split:
            return None  # a TP-split parameter's range is of its TP slice, not of the file's whole tensor
        local = self.param.to_local().detach()
        return local if not local.is_meta and local.is_contiguous() else None

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        """Set this rank's part from ``flat`` (``local_range()``'s elements), materialising a meta tensor."""
        if self.tp_split:
            assert self.param is not None
            a, b = self.param.source_range()
            self.param.to_local().copy_(local_value(self.param, flat.view(self.shape)).reshape(-1)[a:b])
            return
        if self.param is not None:
            self.param.to_local().copy_(flat)
            return
        assert self.value is not None
        if self.value.is_meta:
            # Swap storage into the same object: aliases and optimizers keep referring to it.
            real = flat.reshape(self.shape).to(self.value.dtype, copy=True)
            if isinstance(self.value, nn.Parameter):
                real = type(self.value)(real, requires_grad=self.value.requires_grad)
            torch.utils.swap_tensors(self.value, real)
        else:
            self.value.copy_(flat.reshape(self.shape))


def model_entries(model: nn.Module) -> list[Entry]:
    """Every tensor in ``model``'s state dict, in state-dict order; tied aliases share one entry."""
    by_id: dict[int, Entry] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state dict key {name!r} holds a {type(t).__name__} (a module's extra state); "
                                  "bmt_wrap checkpoints hold tensors only: keep that state in extra=")
        entry = by_id.get(id(t))
        if entry is not None:
            entry.names.append(name)
        elif isinstance(t, DistributedParameter):
            # An expert parameter under EP holds this EP rank's experts: like a TP slice, its entry is the whole
            # tensor, read and written through job/tp_values.py (local_range: the whole; assign: its part).
            split = tp_split_dim(t) is not None or expert_split(t)
            by_id[id(t)] = Entry([name], tuple(whole_shape(t)), t.dtype, param=t, tp_split=split,
                                 ep_names=list_expert_names(t, name) if list_expert(t) else None)
        else:
            by_id[id(t)] = Entry([name], tuple(t.shape), t.dtype, value=t)
    return list(by_id.values())


def with_peers(entries: list[Entry]) -> list[Entry]:
    """``entries`` with every EP rank's list experts, the same names in the same order on every rank (what a
    sharded checkpoint lines up by position): each rank's own in its EP rank's place, the others absent."""
    ep_rank = parallel_layout().ep_rank
    out = []
    for e in entries:
        if e.ep_names is None:
            out.append(e)
            continue
        out += [e if r == ep_rank else Entry([n], e.shape, e.dtype, absent=True) for r, n in enumerate(e.ep_names)]
    return out


def by_buffer(entries: list[Entry]) -> tuple[list[tuple[FlatBuffer, list[Entry]]], list[Entry]]:
    """Sharded entries grouped by flat buffer (first-seen order, slot order inside), and replicated ones."""
    groups: dict[int, tuple[FlatBuffer, list[Entry]]] = {}
    replicated = []
    for e in entries:
        if e.buffer is None:
            replicated.append(e)
        else:
            groups.setdefault(id(e.buffer), (e.buffer, []))[1].append(e)
    for _, members in groups.values():
        members.sort(key=lambda e: e.param.slot_index)  # type: ignore[union-attr]
    return list(groups.values()), replicated


def materialize(entries: list[Entry], device: torch.device) -> None:
    """Give every meta flat buffer of ``entries`` real (zeroed) storage."""
    for buffer, _ in by_buffer(entries)[0]:
        buffer.materialize(device)


def meta_names(entries: list[Entry]) -> list[str]:
    """Names of entries still on the meta device."""
    return [e.name for e in entries if (e.param if e.param is not None else e.value).is_meta]  # type: ignore[union-attr]
