"""How the optimizer side tells a rank's shard of a parameter from a parameter every rank holds whole."""

from __future__ import annotations

import torch

#: Set to True on a parameter every rank holds in full with identical gradients (the engine's resident
#: parameters): the global gradient norm then counts it once instead of once per rank.
REPLICATED_ATTR = "_bmt_replicated"


def is_replicated(p: torch.Tensor) -> bool:
    """True for a parameter marked as held whole, with identical gradients, on every rank."""
    return bool(getattr(p, REPLICATED_ATTR, False))


def is_sharded(p: torch.Tensor) -> bool:
    """True for one rank's slice of a sharded parameter (it carries ``full_shape`` and is not replicated)."""
    return getattr(p, "full_shape", None) is not None and not is_replicated(p)
