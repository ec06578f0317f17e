"""The examples' training text: bytes of real Python source, present wherever torch is installed."""

from __future__ import annotations

from pathlib import Path

import torch


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The installed torch package's ``.py`` files as byte values (sorted, so every rank reads the same bytes)."""
    root = Path(torch.__file__).resolve().parent
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_for_step(corpus: torch.Tensor, step: int, seed: int, global_batch: int, seq: int,
                   rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``: a function of the step, so resuming replays nothing."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq - 1, (global_batch,), generator=g)
    mine = starts.chunk(world)[rank]
    windows = torch.stack([corpus[s:s + seq + 1] for s in mine.tolist()])
    return windows[:, :-1], windows[:, 1:]
