"""Ops a ``ShardedTensor`` cannot answer on its range: gather the full value, compute, return plain tensors.

Transposes, matmuls, reductions along a dimension, indexing and broadcasting against a smaller tensor need
elements other ranks hold (a ragged range is not a block of rows). Each sharded operand's full value is
gathered (its slot's pieces only, ``ShardLayout.gather``), the op runs on plain tensors and returns plain
tensors, as DTensor's redistribution to ``Replicate`` would. An op that writes into a sharded tensor keeps
this rank's range of what it wrote. Every rank must make the call, as for any collective; the first
materialisation of each op warns, and ``bmt.comm_stats()["materialize"]`` counts them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..base._compat import pytree
from ..errors import MaterializeWarning

_stats = {"calls": 0, "bytes": 0}
_warned: set[str] = set()


def materialize_stats() -> dict[str, int]:
    """Calls and bytes of full values gathered for ops that need them, since the last reset."""
    return dict(_stats)


def reset_materialize_stats() -> None:
    """Zero the counts (``bmt.reset_comm_stats`` calls it)."""
    _stats.update(calls=0, bytes=0)


def run_on_full_values(func: Any, args: tuple, kwargs: dict, sharded: type) -> Any:
    """Run ``func`` with every operand of type ``sharded`` (``ShardedTensor``, which calls this) replaced by
    its full value (one gather per distinct tensor)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    fulls: dict[int, torch.Tensor] = {}
    for x in leaves:
        if isinstance(x, sharded) and id(x) not in fulls:
            fulls[id(x)] = _full_value(x, func)
    plain_args, plain_kwargs = pytree.tree_unflatten([fulls.get(id(x), x) for x in leaves], spec)
    out = func(*plain_args, **plain_kwargs)
    if not func._schema.is_mutable:
        return out
    written = _write_back(func, args, kwargs, fulls, sharded)
    if isinstance(args[0], sharded) and written:
        return args[0]
    return out


def _full_value(t: Any, func: Any) -> torch.Tensor:
    layout = t.shard_layout
    name = str(func.overloadpacket.__name__)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"{name} on sharded tensor {layout.name!r} gathers its full value on every rank (a "
                      "collective; further ops of this kind do so silently, bmt.comm_stats()['materialize'] "
                      "counts them). Prefer elementwise ops, or read values with `with bmt.gathered(model):`",
                      MaterializeWarning, stacklevel=4)
    full = layout.gather(t.to_local())
    _stats["calls"] += 1
    _stats["bytes"] += full.numel() * full.element_size()
    return full


def _write_back(func: Any, args: tuple, kwargs: dict, fulls: dict[int, torch.Tensor], sharded: type) -> bool:
    """Keep this rank's range of each written sharded operand; whether any was written."""
    written = False
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, sharded):
                t.to_local().copy_(t.shard_layout.local_of_full(fulls[id(t)]))
                written = True
    return written
