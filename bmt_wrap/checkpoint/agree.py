"""Every rank reaches the same verdict: one all-reduce of per-rank error flags (plus small integers).

A rank that failed on its own (a file it cannot read, a full disk) must not leave the others waiting
in the next collective: all of them raise, with the failing rank's message.
"""

from __future__ import annotations

import torch

from ..distributed import broadcast_bytes, get_state
from ..errors import CheckpointError


def agree(error: str | None, payload: list[int] | None = None, what: str = "checkpoint") -> list[list[int]]:
    """Raise ``CheckpointError`` on every rank if any rank passes an ``error``; else every rank's ``payload``.

    One all-reduce; only on failure, the first failing rank's message is broadcast (two more).
    """
    state = get_state()
    payload = payload or []
    width = 1 + len(payload)
    table = torch.zeros(state.world_size * width, dtype=torch.int64, device=state.device)
    table[state.rank * width] = int(error is not None)
    table[state.rank * width + 1:(state.rank + 1) * width] = torch.tensor(payload, dtype=torch.int64)
    if state.world_size > 1:
        state.comm.all_reduce(table, "sum", label=f"{what} verdict")
    rows = table.cpu().view(state.world_size, width).tolist()
    failed = [r for r, row in enumerate(rows) if row[0]]
    if not failed:
        return [row[1:] for row in rows]
    first = failed[0]
    message = broadcast_bytes(error.encode() if state.rank == first and error else None, src=first).decode()
    if state.rank != first:
        message = f"rank {first}: {message}"
    raise CheckpointError(message)
