"""``OptimManager``: loss scaling, the overflow check across ranks, clipping and scheduler steps."""

from __future__ import annotations

from typing import Any

import torch

from ..base._compat import foreach_div_
from ..base.log import get_logger
from ..errors import OptimizerError
from ..wrapping.grad_sync import check_synced
from .grad_norm import GradRanges, any_rank, clip_grads_, local_overflow
from .loss_scaler import DynamicLossScaler


def _params_of(param_groups: Any) -> list[torch.Tensor]:
    if isinstance(param_groups, torch.Tensor):
        return [param_groups]
    groups = list(param_groups)
    if groups and isinstance(groups[0], dict):
        return [p for g in groups for p in g["params"]]
    return groups


class OptimManager:
    """Steps several optimizers together, with dynamic loss scaling for fp16 (BMTrain's API).

    ``backward`` multiplies the loss by the loss scale (and nothing else: gradients are rank-averaged
    by the engine). ``step`` checks every rank's gradients for inf/nan with one all-reduce; on overflow
    every rank skips the step (parameters, moments and schedulers untouched) and the scale drops; after
    ``loss_scale_steps`` clean steps it grows. ``loss_scale=None`` (bf16/fp32) disables scaling and the
    check. Example::

        mgr = OptimManager(loss_scale=2**16)
        mgr.add_optimizer(opt, lr_scheduler)
        mgr.zero_grad(); mgr.backward(loss); mgr.clip_grad_norm(max_norm=1.0); mgr.step()
    """

    def __init__(self, loss_scale: float | None = None, loss_scale_factor: float = 2, loss_scale_steps: int = 1024,
                 min_loss_scale: float = 1, max_loss_scale: float = 2 ** 24) -> None:
        self.scaler = None if loss_scale is None else DynamicLossScaler(
            loss_scale, loss_scale_factor, loss_scale_steps, min_loss_scale, max_loss_scale)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[Any] = []
        self._ranges = GradRanges()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 without loss scaling)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def add_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> None:
        """Manage ``optimizer`` (any torch optimizer) and step ``lr_scheduler`` after it; all share one loss scale."""
        if any(o is optimizer for o in self.optimizers):
            raise OptimizerError("this optimizer was already added to the OptimManager; add each one once")
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def _params(self) -> list[torch.Tensor]:
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the scaled loss (call several times to accumulate micro-batches)."""
        self.scale_loss(loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every managed optimizer."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> bool:
        """Unscale, check for overflow on every rank, step every optimizer and scheduler; False if skipped."""
        check_synced(self._params(), "OptimManager.step()")
        if self.scaler is not None:
            if any_rank(local_overflow(self._ranges(self._params()).all())):
                old = self.scaler.scale
                self.scaler.on_overflow()
                get_logger().info("gradient overflow: step skipped, loss scale %g -> %g", old, self.scaler.scale)
                return False
        scale = self.loss_scale
        for opt, scheduler in zip(self.optimizers, self.lr_schedulers, strict=True):
            if getattr(opt, "_bmtrain_optimizer", False):
                opt.step(scale=scale)  # unscales inside its fused update
            else:
                if scale != 1.0:
                    foreach_div_(self._ranges(p for g in opt.param_groups for p in g["params"]).all(), scale)
                opt.step()
            if scheduler is not None:
                scheduler.step()
        if self.scaler is not None:
            self.scaler.on_step()
        return True

    def clip_grad_norm(self, param_groups: Any = None, max_norm: float | None = None, norm_type: float | str = 2,
                       eps: float = 1e-6) -> torch.Tensor:
        """Clip gradients to a global norm of ``max_norm`` (one all-reduce); return the norm before clipping.

        BMTrain's form ``clip_grad_norm(opt.param_groups, max_norm, norm_type)``, or
        ``clip_grad_norm(max_norm=...)`` / ``clip_grad_norm(1.0)`` for every managed parameter.
        ``norm_type`` may be ``'inf'``. Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
        """
        if max_norm is None and isinstance(param_groups, (int, float)):
            param_groups, max_norm = None, param_groups
        if max_norm is None:
            raise OptimizerError("clip_grad_norm needs max_norm: clip_grad_norm(max_norm=1.0), or "
                                 "clip_grad_norm(optimizer.param_groups, 1.0)")
        params = self._params() if param_groups is None else _params_of(param_groups)
        check_synced(params, "OptimManager.clip_grad_norm()")
        return clip_grads_(self._ranges(params), float(max_norm), float(norm_type), eps, self.loss_scale)

    def state_dict(self) -> dict[str, Any]:
        """Loss scaler, optimizers and schedulers, in the order they were added."""
        return {
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "lr_schedulers": [None if s is None else s.state_dict() for s in self.lr_schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` into a manager built with the same optimizers and schedulers."""
        if len(state["optimizers"]) != len(self.optimizers):
            raise OptimizerError(f"the saved OptimManager had {len(state['optimizers'])} optimizers, this one has "
                                 f"{len(self.optimizers)}: add the same optimizers, in the same order, before loading")
        if (state["loss_scaler"] is None) != (self.scaler is None):
            raise OptimizerError("the saved OptimManager and this one disagree on loss scaling: build this one "
                                 "with loss_scale=None exactly when the saved one had no loss scaling")
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for scheduler, saved in zip(self.lr_schedulers, state["lr_schedulers"], strict=True):
            if scheduler is not None and saved is not None:
                scheduler.load_state_dict(saved)
