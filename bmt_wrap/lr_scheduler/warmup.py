"""``WarmupLRScheduler``: linear warmup to ``start_lr``, then a decay rule each subclass defines (BMTrain's API)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OptimizerError


class WarmupLRScheduler:
    """Sets every param group's ``lr`` for iteration ``num_iter``: ``get_lr_warmup`` while
    ``num_iter < warmup_iter``, ``get_lr_decay`` after. ``step()`` advances one iteration (OptimManager
    calls it after each optimizer step that was not skipped)."""

    _state_keys: tuple[str, ...] = ("start_lr", "warmup_iter", "end_iter", "num_iter")

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: int, end_iter: int,
                 num_iter: int = 0) -> None:
        if start_lr < 0 or warmup_iter < 0 or num_iter < 0:
            raise OptimizerError(f"{type(self).__name__} needs start_lr >= 0, warmup_iter >= 0 and num_iter >= 0; "
                                 f"got start_lr={start_lr}, warmup_iter={warmup_iter}, num_iter={num_iter}")
        self.optimizer = optimizer
        self.start_lr = start_lr
        self.warmup_iter = warmup_iter
        self.end_iter = end_iter
        self.num_iter = num_iter
        self._current_lr = 0.0
        self.step(num_iter)

    def get_lr_warmup(self, num_iter: int) -> float:
        """Learning rate during warmup: linear from 0 to ``start_lr``."""
        return self.start_lr * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        """Learning rate after warmup."""
        raise NotImplementedError(f"{type(self).__name__} must define get_lr_decay")

    def get_lr(self) -> float:
        """Learning rate for the current iteration."""
        if self.num_iter < self.warmup_iter:
            return self.get_lr_warmup(self.num_iter)
        return self.get_lr_decay(self.num_iter)

    @property
    def current_lr(self) -> float:
        """The learning rate last written to the optimizer."""
        return self._current_lr

    def step(self, num_iter: int | None = None) -> None:
        """Move to iteration ``num_iter`` (default: the next one) and set its learning rate on every group."""
        self.num_iter = self.num_iter + 1 if num_iter is None else num_iter
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self) -> dict[str, Any]:
        """The schedule's parameters and position."""
        return {k: getattr(self, k) for k in self._state_keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` and set the optimizer's learning rate for the restored iteration."""
        for k in self._state_keys:
            setattr(self, k, state[k])
        self.step(self.num_iter)
