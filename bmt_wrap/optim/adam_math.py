"""The hyperparameters of one Adam update and the per-step scalars the fused kernels take."""

from __future__ import annotations

import math
from typing import NamedTuple


class AdamHyper(NamedTuple):
    """Everything that must be equal for two tensors to be updated by one fused call."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1-based count of updates this tensor has received, this one included


def adam_scalars(hyper: AdamHyper, scale: float) -> tuple[float, float, float, float, float, float, float]:
    """The kernel's scalars, in ``bmt::AdamScalars`` order: beta1, beta2, eps, decay, step_size,
    inv_bc2_sqrt, inv_scale (bias corrections computed in double precision, as torch does)."""
    bc1 = 1.0 - hyper.beta1 ** hyper.step
    bc2 = 1.0 - hyper.beta2 ** hyper.step
    return (hyper.beta1, hyper.beta2, hyper.eps, 1.0 - hyper.lr * hyper.weight_decay, hyper.lr / bc1,
            1.0 / math.sqrt(bc2), 1.0 / scale)
