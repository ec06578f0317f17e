"""BMTrain's learning-rate schedules: each defines the decay after warmup."""

from __future__ import annotations

import math

import torch

from .warmup import WarmupLRScheduler


class NoDecay(WarmupLRScheduler):
    """Warmup, then ``start_lr`` for ever."""

    def get_lr_decay(self, num_iter: int) -> float:
        """Constant ``start_lr``."""
        return self.start_lr


class Noam(WarmupLRScheduler):
    """The Transformer schedule: warmup to ``start_lr / sqrt(warmup_iter)``, then ``start_lr / sqrt(num_iter)``."""

    def get_lr_warmup(self, num_iter: int) -> float:
        """Linear warmup to the inverse-square-root curve's value at ``warmup_iter``."""
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter: int) -> float:
        """``start_lr / sqrt(num_iter)`` (iteration 0 counts as 1)."""
        return self.start_lr / math.sqrt(max(num_iter, 1))


class Linear(WarmupLRScheduler):
    """Warmup, then linear decay from ``start_lr`` to 0 at ``end_iter``."""

    def get_lr_decay(self, num_iter: int) -> float:
        """``start_lr * (end_iter - num_iter) / (end_iter - warmup_iter)``, never below 0."""
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / max(1, self.end_iter - self.warmup_iter))


class Cosine(WarmupLRScheduler):
    """Warmup, then half a cosine from ``start_lr`` down to 0 at ``end_iter`` (0 after it)."""

    def get_lr_decay(self, num_iter: int) -> float:
        """``start_lr * (1 + cos(pi * progress)) / 2``; progress stops at 1 rather than rising again."""
        progress = min(1.0, (num_iter - self.warmup_iter) / max(1, self.end_iter - self.warmup_iter))
        return max(0.0, self.start_lr * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Exponential(WarmupLRScheduler):
    """Warmup, then ``start_lr * gamma ** (num_iter - warmup_iter)``."""

    _state_keys = WarmupLRScheduler._state_keys + ("gamma",)

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: int, end_iter: int,
                 num_iter: int = 0, gamma: float = 0.95) -> None:
        self.gamma = gamma  # before the base class sets the first learning rate, which needs it
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def get_lr_decay(self, num_iter: int) -> float:
        """Geometric decay by ``gamma`` per iteration after warmup."""
        return max(0.0, self.start_lr * self.gamma ** (num_iter - self.warmup_iter))
