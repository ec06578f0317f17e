"""A sharded checkpoint (``save_checkpoint``'s directory, saved at any tensor- and data-parallel layout)
read whole in one process, for plain PyTorch: no process group, no wrapper, every file's CRC-32 checked.

    state = bmt.consolidated_state_dict("ckpt/step-1000")          # plain_model.load_state_dict(state)
    optim = bmt.consolidated_optimizer_state("ckpt/step-1000")     # {param name: {"exp_avg": ..., "step": ...}}
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ..base.dtypes import to_dtype
from ..errors import CheckpointError
from . import optim_state
from .reshard import whole
from .sharded import CheckpointReader


def _open(directory: str | os.PathLike) -> CheckpointReader:
    reader = CheckpointReader(Path(directory))
    reader.verify(range(reader.world))
    return reader


def _whole(reader: CheckpointReader, name: str, saved: dict[str, Any]) -> torch.Tensor:
    """File tensor ``name`` (laid out like model tensor ``saved``) whole, in the dtype it was written in."""
    shape = tuple(saved["shape"])
    mine = whole(shape)
    plan = reader.pieces(name, saved, mine)
    dtype = reader.tensors(plan[0][0]).info(name)[1] if plan else to_dtype(saved["dtype"])
    return reader.read(name, plan, mine.numel, dtype).view(shape)


def consolidated_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's whole tensors by ``state_dict`` key (tied aliases: one tensor under each key), for a plain
    model's ``load_state_dict``; raises ``CheckpointError`` naming a missing, truncated or corrupt file."""
    reader = _open(directory)
    out: dict[str, torch.Tensor] = {}
    for saved in reader.meta["model"]:
        value = _whole(reader, f"model/{saved['names'][0]}", saved)
        out.update((n, value) for n in saved["names"])
    return out


def consolidated_optimizer_state(directory: str | os.PathLike, k: int = 0) -> dict[str, dict[str, Any]]:
    """Optimizer ``k``'s state by parameter name (element-wise tensors whole, shaped like the parameter;
    a step count or other value as saved), and nothing for parameters it holds no state for."""
    reader = _open(directory)
    if not 0 <= k < len(reader.optimizers):
        raise CheckpointError(f"{reader.directory} holds state of {len(reader.optimizers)} optimizer(s); "
                              f"there is no optimizer {k}")
    out: dict[str, dict[str, Any]] = {}
    for name, keys in reader.optimizers[k]["state"].items():
        saved = reader.entries[name]
        for key, kind in keys.items():
            tname = optim_state.tensor_key(k, name, key)
            if kind == optim_state.SHARDED:
                value: Any = _whole(reader, tname, saved)
            elif kind == optim_state.REPLICATED:
                src = reader.holder(name, tname)
                shape = src.info(tname)[0]
                value = src.read(tname, 0, math.prod(shape)).reshape(shape).clone()
            else:
                value = reader.value(k, name, key)
            out.setdefault(name, {})[key] = value
    return out
