"""World size 1: every collective is a copy (or nothing), no process group traffic."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ...errors import CommError
from .base import Communicator, DoneHandle, Handle


class SingleProcessCommunicator(Communicator):
    """The communicator of a one-rank job; a send to itself waits for the matching receive in a mailbox."""

    backend_name = "single-process"

    def __init__(self, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__(rank=0, world_size=1, timeout=timeout)
        self._mailbox: dict[int, list[torch.Tensor]] = {}

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        return SingleProcessCommunicator(self.timeout)

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return DoneHandle()

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return DoneHandle()

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        return DoneHandle()

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        return DoneHandle()

    def _barrier(self, label: str) -> Handle:
        return DoneHandle()

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DoneHandle()

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        self._mailbox.setdefault(tag, []).append(tensor.clone())
        return DoneHandle()

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        queued = self._mailbox.get(tag)
        if not queued:
            raise CommError(f"recv{f' for {label!r}' if label else ''} (tag {tag}): nothing was sent to this "
                            "single rank under that tag; send before receiving")
        sent = queued.pop(0)
        if sent.numel() != tensor.numel() or sent.dtype != tensor.dtype:
            raise CommError(f"recv (tag {tag}): {sent.numel()} x {sent.dtype} was sent, the receive takes "
                            f"{tensor.numel()} x {tensor.dtype}")
        tensor.copy_(sent)
        return DoneHandle()
