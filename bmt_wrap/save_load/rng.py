"""Each rank's random number generators, captured and restored (or reseeded) with a checkpoint."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..job.distributed import seed_everything


def capture() -> dict[str, Any]:
    """This rank's torch (CPU and CUDA), numpy and Python RNG states, as plain tensors and tuples."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def reseed(seed: int | None, step: int, rank: int) -> int | None:
    """Seed every RNG with ``(seed * 1_000_003 + step) * 1_000_003 + rank`` (mod 2**63); returns it.

    Used when a checkpoint is resumed at another world size, where saved per-rank states have no owner.
    A job saved under ``init_distributed(seed=None)`` seeds its RNGs itself: they are left alone (None).
    """
    if seed is None:
        return None
    derived = ((seed * 1_000_003 + step) * 1_000_003 + rank) % 2**63
    seed_everything(derived)
    return derived
