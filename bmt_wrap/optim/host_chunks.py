"""``AdamOptimizer`` on shards offloaded to host memory by a CUDA job (``offload="host"``): each run of
parameter, gradient and moments is brought to the device a chunk at a time, updated there by the kernel the
in-memory job runs, and copied back. The update is elementwise, so chunking changes no bit of it, and the
device holds one chunk of each tensor, not the shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..base.plan import HOST_STEP_CHUNK_ELEMS

#: Elements per chunk of each tensor (the plan counts this much of the optimizer state on the device).
CHUNK_ELEMS = HOST_STEP_CHUNK_ELEMS


def step_through_device(items: Sequence[tuple[torch.Tensor, ...]], device: torch.device, scale: float,
                        update: Callable[[list[torch.Tensor]], None]) -> None:
    """For each ``(param, grad, exp_avg, exp_avg_sq[, master])`` of host tensors: ``update`` the same tuple of
    device copies, chunk by chunk, and write the changed ones back (the gradient only when ``scale``
    unscaled it in place)."""
    for item in items:
        flat = [t.reshape(-1) for t in item]
        n = flat[0].numel()
        for lo in range(0, n, CHUNK_ELEMS):
            hi = min(n, lo + CHUNK_ELEMS)
            on_device = [t[lo:hi].to(device, copy=True) for t in flat]
            update(on_device)
            for i, (host, dev) in enumerate(zip(flat, on_device, strict=True)):
                if i != 1 or scale != 1.0:
                    host[lo:hi].copy_(dev)
