"""Dynamic loss scaling: drop the scale on overflow, grow it after a run of clean steps."""

from __future__ import annotations

from typing import Any

from ..errors import OptimizerError


class DynamicLossScaler:
    """The loss-scale schedule ``OptimManager`` follows (state only; the manager does the checking)."""

    def __init__(self, scale: float, factor: float = 2, steps: int = 1024, min_scale: float = 1,
                 max_scale: float = 2 ** 24) -> None:
        if factor <= 0 or steps < 1 or not 0 < min_scale <= scale <= max_scale:
            raise OptimizerError(
                f"invalid loss scaling: need loss_scale_factor > 0, loss_scale_steps >= 1 and "
                f"0 < min_loss_scale <= loss_scale <= max_loss_scale; got factor={factor}, steps={steps}, "
                f"min={min_scale}, scale={scale}, max={max_scale}")
        self.scale = float(scale)
        # BMTrain accepts a shrink factor (0.5) as well as a growth factor (2): both mean the same.
        self.factor = float(factor) if factor >= 1 else 1.0 / factor
        self.steps = steps
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.steps_since_last_scale = 0

    def on_overflow(self) -> None:
        """A step was skipped: shrink the scale (not below the minimum) and restart the clean-step count."""
        self.scale = max(self.scale / self.factor, self.min_scale)
        self.steps_since_last_scale = 0

    def on_step(self) -> None:
        """A clean step was taken: grow the scale (not above the maximum) after ``steps`` of them."""
        self.steps_since_last_scale += 1
        if self.steps_since_last_scale >= self.steps:
            self.scale = min(self.scale * self.factor, self.max_scale)
            self.steps_since_last_scale = 0

    def state_dict(self) -> dict[str, Any]:
        """The scale and its progress, for checkpoints."""
        return {"scale": self.scale, "steps_since_last_scale": self.steps_since_last_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.scale = float(state["scale"])
        self.steps_since_last_scale = int(state["steps_since_last_scale"])
