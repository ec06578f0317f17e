"""Debug mode (``BMT_WRAP_DEBUG=1``): before every collective, ranks agree on what they are about to do.

gloo times out on a mismatched collective only when the sizes differ; two ranks in different blocks of
the same shape would exchange the wrong data silently. Here each op is preceded by an all-reduce of
``[h, -h]`` with MAX, where ``h`` hashes what defines the op (``purpose.describe_op``): every rank sees
whether all ranks agree, so every rank raises ``CollectiveMismatchError`` naming both sides.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import CollectiveMismatchError
from .base import Communicator, CommunicatorWrapper, Handle
from .purpose import RECORD_BYTES, OpDescription, describe_op, mismatch_message


class FingerprintCommunicator(CommunicatorWrapper):
    """Checks that every rank issues the same collective before forwarding it to ``inner``."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self._sequence = 0

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        return FingerprintCommunicator(self.inner.subgroup(ranks, group))

    def _check(self, op: str, t: torch.Tensor | None, label: str, arg: str | int = "") -> None:
        mine = describe_op(op, t, label, arg)
        h = int.from_bytes(mine.key, "little") >> 2  # fits int64 with room for the negation
        self._sequence += 1
        # A barrier has no tensor: the probe goes where the backend's collectives read (NCCL: the device).
        probe = torch.tensor([h, -h], dtype=torch.int64, device=t.device if t is not None else self.device or "cpu")
        self.inner._all_reduce(probe, "max", "fingerprint").wait()
        hi, neg_lo = (int(v) for v in probe.tolist())
        if hi != h or -neg_lo != h:
            # Every rank saw the disagreement (MAX is global), so all take part in naming each side.
            raise CollectiveMismatchError(mismatch_message(self._sequence, self._exchange(mine, probe.device)))

    def _exchange(self, mine: OpDescription, device: torch.device) -> dict[int, OpDescription]:
        every = torch.zeros(RECORD_BYTES * self.world_size, dtype=torch.uint8, device=device)
        self.inner._all_gather_into(every, mine.encode().to(device), "fingerprint descriptions").wait()
        return {r: OpDescription.decode(row) for r, row in enumerate(every.view(self.world_size, RECORD_BYTES))}

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        self._check("all_gather_into", shard, label)
        return self.inner._all_gather_into(out, shard, label)

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        self._check("reduce_scatter_into", out, label, op)
        return self.inner._reduce_scatter_into(out, full, op, label)

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        self._check("all_reduce", tensor, label, op)
        return self.inner._all_reduce(tensor, op, label)

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        self._check("broadcast", tensor, label, f"from rank {src}")
        return self.inner._broadcast(tensor, src, label)

    def _barrier(self, label: str) -> Handle:
        self._check("barrier", None, label)
        return self.inner._barrier(label)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        self._check("all_to_all", None, f"{label} ({inp.dtype})")  # sizes differ by rank: not part of the op
        return self.inner._all_to_all(out, inp, out_splits, in_splits, label)

    # Point to point: two ranks of the group take part, so no group-wide fingerprint; the receiver checks
    # the sender's header (runtime/pipeline.py), and a missing peer times out.
    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        return self.inner._send(tensor, dst, tag, label)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        return self.inner._recv(tensor, src, tag, label)
