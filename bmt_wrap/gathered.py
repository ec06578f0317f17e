"""``with bmt.gathered(model):`` — full parameters for a while (like FSDP's ``summon_full_params``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .runtime.group import ShardGroup
from .runtime.param import DistributedParameter


def sharded_groups(model: nn.Module) -> list[ShardGroup]:
    """Every shard group holding a parameter of ``model``, in parameter order."""
    seen: dict[int, ShardGroup] = {}
    for p in model.parameters():
        if isinstance(p, DistributedParameter):
            g = p._bmt_buffer.group
            seen.setdefault(id(g), g)
    return list(seen.values())


@contextmanager
def gathered(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Install full parameters in ``model`` (a collective); on exit, keep changes if ``writeback``.

    Holds the whole model on every rank while inside: meant for inspection, evaluation tweaks and small
    models. Use ``bmt.save`` to write big models.
    """
    groups = sharded_groups(model)
    for g in groups:
        g.start_gather()
    installed: list[tuple[ShardGroup, list[list[nn.Parameter]]]] = []
    try:
        for g in groups:
            full = [[nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, b.params)]
                    for views, b in zip(g.slot_views(), g.buffers)]
            g.install(full)
            installed.append((g, full))
        yield model
        if writeback:
            with torch.no_grad():
                for g, full in installed:
                    for b, params in zip(g.buffers, full):
                        for i, p in enumerate(params):
                            b.load_slot(i, p)
    finally:
        for g in groups:
            g.restore()
            g.release()
