"""Sharded optimizer (and model) state with ``torch.distributed.checkpoint`` (DCP): the format the tool
integrations write. Each rank writes its own elements; a load reshards to any world size and any
tensor-parallel size (a TP-split parameter's elements are placed by its TP slice: ``param_shard``).

These are thin: ``get_model_state_dict``/``get_optimizer_state_dict`` on a wrapped model already return
``LocalShard``s (see ``local_shard.py`` and ``optim_shards.py``); this module only names the calls.
"""

from __future__ import annotations

import json
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
from .atomic import make_dirs, os_errors, require_directory, write_atomic
from .checksum import check_crc32, file_crc32

CHECKSUMS = "checksums.json"  # file name -> CRC-32 of every file of the save


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
    leaves the old save in ``.<name>.old`` and the new, complete one in ``.<name>.saving``. Every file's
    CRC-32 (each computed by one rank) goes into ``checksums.json``, which ``load_directory`` checks.
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
            except CheckpointError as exc:
                error = str(exc)
        agree(error, what="save")
        sums = _checksums(saving)
        if rank0:
            try:
                write_atomic(saving / CHECKSUMS, json.dumps(sums, indent=1).encode())
                with os_errors(saving, "write"):
                    if target.exists():
                        shutil.rmtree(old, ignore_errors=True)
                        target.rename(old)
                    saving.rename(target)
                    shutil.rmtree(old, ignore_errors=True)
            except CheckpointError as exc:
                error = str(exc)
        agree(error, what="save")


def _checksums(directory: Path) -> dict[str, int]:
    """Every file's CRC-32 in ``directory`` (file k computed by rank k mod world); a collective."""
    state = get_state()
    error, names, mine = None, [], []
    try:
        with os_errors(directory, "list"):
            names = sorted(f.name for f in directory.iterdir() if f.is_file())
    except CheckpointError as exc:
        error = exc
    if len({row[0] for row in agree(error, [len(names)], what="file count")}) > 1:
        raise CheckpointError(f"the ranks see different files in {directory}: save to a directory every rank "
                              "shares (one file system)")
    try:
        mine = [file_crc32(directory / n) if k % state.world_size == state.rank else 0 for k, n in enumerate(names)]
    except CheckpointError as exc:
        error = exc
    table = agree(error, mine if error is None else [0] * len(names), what="checksums")
    return {n: table[k % state.world_size][k] for k, n in enumerate(names)}


def _verify(directory: Path) -> None:
    """Check this rank's share of the files ``checksums.json`` lists (all there, none changed); every rank
    raises if one fails. A save from before checksums were written has none to check."""
    state = get_state()
    error = None
    try:
        listed_sums = directory / CHECKSUMS
        if listed_sums.is_file():
            with os_errors(listed_sums, "read"):
                sums = json.loads(listed_sums.read_text())
            for k, (name, crc) in enumerate(sorted(sums.items())):
                if k % state.world_size == state.rank:
                    check_crc32(directory / name, crc)
    except (CheckpointError, ValueError) as exc:
        error = exc if isinstance(exc, CheckpointError) else f"{directory / CHECKSUMS} is corrupted ({exc})"
    agree(error, what="load verify")


def load_directory(directory: str | os.PathLike, state: dict[str, Any]) -> None:
    """Read a complete ``save_directory`` save into ``state``'s tensors, in place (at any world size); a collective."""
    import torch.distributed.checkpoint as dcp

    require_directory(Path(directory))
    if not (Path(directory) / ".metadata").is_file():
        raise CheckpointError(f"{directory} holds no torch.distributed.checkpoint metadata (.metadata): it is not a "
                              "sharded checkpoint, or its save did not finish; resume from an earlier checkpoint")
    _verify(Path(directory))
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
