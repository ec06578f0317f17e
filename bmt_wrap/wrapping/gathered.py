"""``with bmt.gathered(model):`` — full parameters for a while (like FSDP's ``summon_full_params``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..runtime.group import ShardGroup
from ..runtime.module_params import installed, registrations
from ..runtime.param import DistributedParameter


def sharded_groups(model: nn.Module) -> list[ShardGroup]:
    """Every shard group holding a parameter of ``model``, in parameter order."""
    seen: dict[int, ShardGroup] = {}
    for p in model.parameters():
        if isinstance(p, DistributedParameter):
            g = p.shard_group
            seen.setdefault(id(g), g)
    return list(seen.values())


@contextmanager
def gathered(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Install full parameters in ``model`` (a collective); on exit, keep changes if ``writeback``.

    Holds the whole model on every rank while inside: meant for inspection, evaluation tweaks and small
    models. Use ``bmt.save`` to write big models.
    """
    # One flat buffer at a time, in parameter order (under pipeline parallelism a stage's groups hold other
    # buffers than the ghosts other stages hold of them, but each buffer is the same everywhere).
    buffers = list({id(p.flat_buffer): p.flat_buffer for p in model.parameters()
                    if isinstance(p, DistributedParameter)}.values())
    # Where each sharded parameter sits, found by walking the model: a bare DistributedParameter's
    # group does not know the module it was assigned to.
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module, attr, p in registrations(model):
        if isinstance(p, DistributedParameter):
            sites.setdefault(id(p), []).append((module, attr))
    full: list[tuple[DistributedParameter, nn.Parameter]] = []
    for b in buffers:
        # Shard-dtype values: under mixed precision a param_dtype copy would lose the fp32 masters'
        # precision on writeback.
        values = b.slot_views(b.group.gather_values(only=b)[0])
        full += [(p, nn.Parameter(v, requires_grad=p.requires_grad)) for p, v in zip(b.params, values, strict=True)]
    with installed((module, attr, whole) for p, whole in full for module, attr in sites.get(id(p), [])):
        yield model
        if writeback:
            with torch.no_grad():
                for p, whole in full:
                    p.load_full(whole)
