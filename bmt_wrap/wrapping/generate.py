"""``model.generate(...)`` on a wrapped ``transformers`` model: safe and fast under sharding.

Safe: every forward gathers parameters (a collective), so a rank that stopped at its EOS while another
still generates would leave that one waiting forever. transformers keeps finished ranks stepping with
``synced_gpus=True``, which it turns on by itself only for DeepSpeed ZeRO-3 and FSDP; a wrapped model
gets it by default whenever the world size is above one.

Fast: a token's forward runs every block on one position, so gathering each block per token would move
the whole model per token. When the gathered model fits (half of the memory every rank has free, agreed
across ranks), every group is gathered once for the whole ``generate`` call and held
(``Engine.resident``); otherwise blocks gather per step as in training. ``BMT_WRAP_GENERATE_GATHER``
chooses: ``auto`` (default), ``once`` or ``per-step``.
"""

from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..base.log import get_logger
from ..errors import WrapError
from ..job.distributed import agree, get_state
from ..runtime.active_engine import get_engine
from .gathered import sharded_groups

_POLICIES = ("auto", "once", "per-step")


def attach_generate(model: nn.Module) -> None:
    """Give a wrapped model with a ``generate`` method the synced, gather-once version of it."""
    original = getattr(model, "generate", None)
    if not callable(original) or getattr(original, "_bmt_generate", False):
        return

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if get_state().world_size > 1 and kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True  # ranks stop together: a finished rank keeps stepping
        with _gathered_once(model) if _gather_once(model) else nullcontext():
            return original(*args, **kwargs)

    generate._bmt_generate = True  # type: ignore[attr-defined]
    model.generate = generate  # an instance attribute: the class and other instances stay as they were


def _policy() -> str:
    policy = os.environ.get("BMT_WRAP_GENERATE_GATHER", "auto")
    if policy not in _POLICIES:
        raise WrapError(f"BMT_WRAP_GENERATE_GATHER={policy!r}; use one of {', '.join(_POLICIES)}")
    return policy


def _gather_once(model: nn.Module) -> bool:
    """True if every rank can hold the whole gathered model for the generate call (agreed on all ranks)."""
    policy = _policy()
    if policy != "auto":
        return policy == "once"
    need = sum(g.spec.padded_bytes(get_state().world_size) for g in _own_groups(model))
    free = _free_bytes()
    fits = [row[0] for row in agree(None, [int(need <= free // 2)], what="generate memory")]
    decision = all(fits)
    get_logger().debug("generate: gathered model %.1f MB, free %.1f MB on this rank: %s", need / 1e6,
                       free / 1e6, "gather once per call" if decision else "gather per step")
    return decision


def _free_bytes() -> int:
    """Memory this rank could still allocate on the model's device."""
    state = get_state()
    if state.device.type == "cuda":
        return int(torch.cuda.mem_get_info(state.device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _own_groups(model: nn.Module) -> list:
    """The groups this rank runs (under pipeline parallelism its stage's: the others are ghosts here)."""
    return [g for g in sharded_groups(model) if not g.ghost]


def _gathered_once(model: nn.Module) -> Any:
    return get_engine().resident(_own_groups(model))

