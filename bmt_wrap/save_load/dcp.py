"""Sharded optimizer (and model) state with ``torch.distributed.checkpoint`` (DCP): the format the tool
integrations write. Each rank writes its own elements; a load reshards to any world size and any
tensor-parallel size (a TP-split parameter's elements are placed by its TP slice: ``param_shard``).

These are thin: ``get_model_state_dict``/``get_optimizer_state_dict`` on a wrapped model already return
``LocalShard``s (see ``local_shard.py`` and ``optim_shards.py``); this module only names the calls.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..job.distributed import get_state
from ..runtime.comm import collective_purpose
from ..runtime.param import DistributedParameter
from .agree import agree, agree_on_directory
from .atomic import make_dirs, os_errors, require_directory


def holds_sharded_parameters(obj: nn.Module | torch.optim.Optimizer) -> bool:
    """True if a module's parameters, or an optimizer's, include sharded ones (a wrapped model's)."""
    params: Iterable[Any] = (obj.parameters() if isinstance(obj, nn.Module)
                             else (p for g in obj.param_groups for p in g["params"]))
    return any(isinstance(p, DistributedParameter) for p in params)


def owner_of(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> nn.Module:
    """The model among ``models`` whose parameters ``optimizer`` updates (DCP names its state by them)."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if mine <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(f"{type(optimizer).__name__} updates parameters of no single prepared model: build each "
                          "optimizer over one wrapped model's parameters (model.parameters() or param groups of them)")


def save_directory(directory: str | os.PathLike, state: dict[str, Any], rank0_files: dict[str, Any] | None = None
                   ) -> None:
    """Write ``state`` with DCP (every rank its part) and ``rank0_files`` (name -> object, ``torch.save``d by
    rank 0) into ``directory``, replacing an earlier save there only once the new one is complete; a collective.

    DCP alone overwrites in place, so a crash mid-save would leave old and new files mixed. Here the new
    save goes to a sibling ``.<name>.saving`` and is renamed into place; a crash between the two renames
    leaves the old save in ``.<name>.old`` and the new, complete one in ``.<name>.saving``.
    """
    import torch.distributed.checkpoint as dcp

    target = Path(directory)
    saving, old = target.parent / f".{target.name}.saving", target.parent / f".{target.name}.old"
    with collective_purpose("save_directory", str(target)):
        agree_on_directory(target, "checkpoint.dcp.save_directory")
        rank0 = get_state().rank == 0
        error = None
        if rank0:
            try:
                shutil.rmtree(saving, ignore_errors=True)
                make_dirs(saving)
            except CheckpointError as exc:
                error = str(exc)
        agree(error, what="save")
        dcp.save(state, checkpoint_id=str(saving))
        if rank0:
            try:
                with os_errors(saving, "write"):
                    for name, obj in (rank0_files or {}).items():
                        torch.save(obj, saving / name)
                    if target.exists():
                        shutil.rmtree(old, ignore_errors=True)
                        target.rename(old)
                    saving.rename(target)
                    shutil.rmtree(old, ignore_errors=True)
            except CheckpointError as exc:
                error = str(exc)
        agree(error, what="save")


def load_directory(directory: str | os.PathLike, state: dict[str, Any]) -> None:
    """Read a complete ``save_directory`` save into ``state``'s tensors, in place (at any world size); a collective."""
    import torch.distributed.checkpoint as dcp

    require_directory(Path(directory))
    if not (Path(directory) / ".metadata").is_file():
        raise CheckpointError(f"{directory} holds no torch.distributed.checkpoint metadata (.metadata): it is not a "
                              "sharded checkpoint, or its save did not finish; resume from an earlier checkpoint")
    dcp.load(state, checkpoint_id=str(directory))


def save_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, with_model: bool = True) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to ``directory`` with DCP; a collective."""
    save_directory(directory, _dcp_state(model, optimizer, with_model))


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, with_model: bool) -> dict[str, Any]:
    """DCP's state dicts of ``model`` (if ``with_model``) and ``optimizer``: what a save writes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    if with_model:
        state["model"] = get_model_state_dict(model)
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def load_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, with_model: bool = True) -> None:
    """Read what ``save_sharded`` wrote (at any world size) into ``model`` and ``optimizer``; a collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _dcp_state(model, optimizer, with_model)
    load_directory(directory, state)
    if with_model:
        set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
