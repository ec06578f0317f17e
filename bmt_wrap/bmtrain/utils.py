"""BMTrain's ``bmt.utils`` helpers that training scripts use."""

from __future__ import annotations


class AverageRecorder:
    """Bias-corrected exponential moving average of a recorded quantity (BMTrain's ``AverageRecorder``).

    ``AverageRecorder(alpha=0.9, start_value=0)``; ``record(v)`` folds ``v`` in as
    ``alpha * old + (1 - alpha) * v``; ``value`` divides by ``1 - alpha ** steps`` so early values are
    not pulled towards ``start_value``.
    """

    def __init__(self, alpha: float = 0.9, start_value: float = 0) -> None:
        self._value = start_value
        self.alpha = alpha
        self._steps = 0

    def record(self, v: float) -> None:
        """Fold one new value into the average."""
        self._value = self._value * self.alpha + v * (1 - self.alpha)
        self._steps += 1

    @property
    def value(self) -> float:
        """The current average (``start_value`` before anything was recorded)."""
        if self._steps == 0:
            return self._value
        return self._value / (1 - self.alpha ** self._steps)
