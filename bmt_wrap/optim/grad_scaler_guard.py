"""Refuse ``torch.amp.GradScaler`` on sharded gradients across ranks.

GradScaler checks for inf/nan on this rank's gradients only; with sharded gradients each rank sees a
different slice, so one rank skips a step that the others take and the shards silently diverge.
``OptimManager`` all-reduces the overflow flag instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..base._compat import called_from, grad_scaler_step_codes
from ..errors import OptimizerError
from ..job.distributed import current_state
from .sharding import is_sharded

# GradScaler reaches optimizer.step() through one of these (subclasses such as torch.cuda.amp's inherit them).
_SCALER_CODES = grad_scaler_step_codes()
# Frames between GradScaler and this check: step wrappers, no_grad, hooks.
_MAX_DEPTH = 12

_guard: RemovableHandle | None = None


def check_no_grad_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``OptimizerError`` if a GradScaler is stepping ``optimizer`` over sharded parameters on several ranks."""
    state = current_state()
    if state is None or state.world_size == 1 or not called_from(_SCALER_CODES, _MAX_DEPTH):
        return
    if any(is_sharded(p) for group in optimizer.param_groups for p in group["params"]):
        raise OptimizerError(
            "torch.amp.GradScaler is stepping an optimizer over sharded parameters on "
            f"{state.world_size} ranks: it checks inf/nan on this rank's shard only, so ranks would skip "
            "different steps and diverge. Use bmt_wrap.optim.OptimManager(loss_scale=...) instead: "
            "mgr.add_optimizer(opt); mgr.backward(loss); mgr.step() (its overflow check spans all ranks).")


def install_grad_scaler_guard() -> None:
    """Run ``check_no_grad_scaler`` before every optimizer step in this process (idempotent)."""
    global _guard
    if _guard is None:
        _guard = register_optimizer_step_pre_hook(_hook)


def _hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    check_no_grad_scaler(optimizer)
