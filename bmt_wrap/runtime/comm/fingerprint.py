"""Debug mode (``BMT_WRAP_DEBUG=1``): before every collective, ranks agree on what they are about to do.

gloo times out on a mismatched collective only when the sizes differ; two ranks in different blocks of
the same shape would exchange the wrong data silently. Here each op is preceded by an all-reduce of
``[h, -h]`` with MAX, where ``h`` hashes the op, size, dtype and label: every rank sees whether all
ranks agree, so every rank raises ``CollectiveMismatchError`` naming both sides.
"""

from __future__ import annotations

import hashlib

import torch

from ...errors import CollectiveMismatchError
from .base import Communicator, CommunicatorWrapper, Handle


class FingerprintCommunicator(CommunicatorWrapper):
    """Checks that every rank issues the same collective before forwarding it to ``inner``."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self._sequence = 0

    def _check(self, op: str, t: torch.Tensor | None, label: str) -> None:
        what = f"{op}({t.numel()} x {t.dtype})" if t is not None else op
        if label:
            what += f" for {label!r}"
        digest = hashlib.blake2b(what.encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") >> 2  # fits int64 with room for the negation
        self._sequence += 1
        probe = torch.tensor([h, -h], dtype=torch.int64, device=t.device if t is not None else "cpu")
        if probe.device.type == "cpu" and self.inner.backend_name in ("cupy-nccl", "torch-nccl"):
            probe = probe.cuda()
        self.inner._all_reduce(probe, "max", f"fingerprint of {what}").wait()
        hi, neg_lo = (int(v) for v in probe.tolist())
        if hi != h or -neg_lo != h:
            # Every rank saw the disagreement (MAX is global), so all take part in naming each side.
            theirs = self._exchange(what, probe.device)
            sides = "; ".join(f"rank {r}: {w}" for r, w in enumerate(theirs))
            raise CollectiveMismatchError(
                f"collective #{self._sequence} differs across ranks ({sides}). A block was skipped or "
                "repeated on some ranks: data-dependent control flow around blocks must take the same "
                "path on every rank.")

    def _exchange(self, what: str, device: torch.device) -> list[str]:
        width = 256
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        raw = what.encode()[:width]
        mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        every = torch.zeros(width * self.world_size, dtype=torch.uint8, device=device)
        self.inner._all_gather_into(every, mine, "fingerprint descriptions").wait()
        rows = every.view(self.world_size, width).cpu().tolist()
        return [bytes(b for b in row if b).decode(errors="replace") for row in rows]

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        self._check("all_gather_into", shard, label)
        return self.inner._all_gather_into(out, shard, label)

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        self._check("reduce_scatter_into", out, label)
        return self.inner._reduce_scatter_into(out, full, op, label)

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        self._check("all_reduce", tensor, label)
        return self.inner._all_reduce(tensor, op, label)

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        self._check("broadcast", tensor, label)
        return self.inner._broadcast(tensor, src, label)

    def _barrier(self, label: str) -> Handle:
        self._check("barrier", None, label)
        return self.inner._barrier(label)
