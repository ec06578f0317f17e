"""Optimizer state by parameter name, so it can move between world sizes.

Works for any ``torch.optim.Optimizer`` over a model's parameters (ours included): per-parameter state
tensors shaped like a sharded parameter's slice are resharded with it; other tensors (a 0-d ``step``)
and plain values are taken from rank 0. Hyperparameters of each param group travel with rank 0's file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError, listed
from ..runtime.sharded_tensor import local_view
from .optim_shards import is_state_slice, local_state_dict

SHARDED, REPLICATED, VALUE = "sharded", "replicated", "value"


def optimizers_of(optim_manager: Any, optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizers to checkpoint: the manager's, in the order they were added, then ``optimizer``."""
    found = list(optim_manager.optimizers) if optim_manager is not None else []
    if optimizer is not None and not any(o is optimizer for o in found):
        found.append(optimizer)
    return found


def tensor_key(k: int, name: str, key: str) -> str:
    """The file name of optimizer ``k``'s state ``key`` of parameter ``name``."""
    return f"optim/{k}/{name}/{key}"


def _group_names(params: list[torch.Tensor], names: dict[int, str], peers: dict[str, list[str]]) -> list[str]:
    """A param group's parameters by name, a list expert under EP as every EP rank's at its place (``peers``):
    the same group at any ``ep_size``."""
    return [n for p in params for n in peers.get(names.get(id(p), "?"), [names.get(id(p), "?")])]


def capture(k: int, opt: torch.optim.Optimizer, names: dict[int, str], peers: dict[str, list[str]]
            ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, Any]], dict[str, dict[str, str]], list]:
    """Optimizer ``k``'s state: file tensors, plain values, the kind of each state key, and param groups
    (hyperparameters, parameters by name)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    values: dict[str, dict[str, Any]] = {}
    kinds: dict[str, dict[str, str]] = {}
    groups = []
    for g in opt.param_groups:
        unknown = [tuple(p.shape) for p in g["params"] if id(p) not in names]
        if unknown:
            raise CheckpointError(f"optimizer {k} ({type(opt).__name__}) holds parameters that are not the model's "
                                  f"(shapes {listed(unknown, 3)}): build it over model.parameters()")
        groups.append({**{key: v for key, v in g.items() if key != "params"},
                       "params": _group_names(g["params"], names, peers)})
    # An optimizer whose state lives elsewhere (AdamDiskOptimizer's file) reads it in to be saved.
    state = opt.full_state() if hasattr(opt, "full_state") else opt.state
    for p, st in state.items():
        name = names[id(p)]
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                sharded = is_state_slice(p, v)
                kinds.setdefault(name, {})[key] = SHARDED if sharded else REPLICATED
                tensors.append((tensor_key(k, name, key), local_view(v).detach()))
            else:
                kinds.setdefault(name, {})[key] = VALUE
                values.setdefault(name, {})[key] = v
    return tensors, values, kinds, groups


def check_groups(k: int, opt: torch.optim.Optimizer, names: dict[int, str], saved_groups: list,
                 peers: dict[str, list[str]]) -> str | None:
    """Why ``opt`` cannot take optimizer ``k``'s saved state, or None."""
    mine = [sorted(_group_names(g["params"], names, peers)) for g in opt.param_groups]
    theirs = [sorted(g["params"]) for g in saved_groups]
    if mine == theirs:
        return None
    if len(mine) != len(theirs):
        return (f"optimizer {k} has {len(mine)} param groups, the checkpoint's has {len(theirs)}: build it with the "
                "same param groups as the one that was saved")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a != b:
            extra, gone = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            return (f"optimizer {k} param group {i} differs from the checkpoint's: not saved [{listed(extra)}], not "
                    f"in this optimizer [{listed(gone)}]: build it with the same param groups as the one that was saved")
    return None


def restore(opt: torch.optim.Optimizer, names: dict[int, str], saved_groups: list, kinds: dict[str, dict[str, str]],
            read: Callable[[str, str, str], Any], peers: dict[str, list[str]]) -> None:
    """Load the saved state into ``opt``; ``read(name, key, kind)`` returns one state value for this rank."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    saved_by_names = {tuple(sorted(g["params"])): g for g in saved_groups}
    for g in opt.param_groups:
        params = [names[id(p)] for p in g["params"]]
        saved = saved_by_names[tuple(sorted(_group_names(g["params"], names, peers)))]
        ids = []
        for name in params:
            if name in kinds:
                state[index] = {key: read(name, key, kind) for key, kind in kinds[name].items()}
            ids.append(index)
            index += 1
        groups.append({**{key: v for key, v in saved.items() if key != "params"}, "params": ids})
    # Each rank's slice becomes state laid out like its parameter, whether or not ``opt`` has stepped.
    opt.load_state_dict(local_state_dict(opt, {"state": state, "param_groups": groups}))
