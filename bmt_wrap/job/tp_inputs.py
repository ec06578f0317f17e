"""The check that the ranks of one tensor-parallel group were given the same batch.

TP peers compute one model replica together, so each must see the same inputs; a data loader sharded
over the whole world instead of over the data-parallel group gives them different batches and trains
on garbage without any error. One all-reduce of a digest per rank over the TP group finds it, and every
rank of the group raises the same ``TPInputMismatchError``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from ..errors import TPInputMismatchError
from .distributed import tensor_parallel


def _digest(tensors: Iterable[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        data = t.detach().contiguous().cpu()
        crc = zlib.crc32(repr((tuple(data.shape), str(data.dtype))).encode(), crc)
        crc = zlib.crc32(data.view(torch.uint8).reshape(-1).numpy().tobytes() if data.numel() else b"", crc)
    return crc


def tp_digests(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Every TP rank's digest of its ``tensors`` (shapes, dtypes, values): one all-reduce over the TP group."""
    layout = tensor_parallel()
    table = torch.zeros(layout.tp_size, dtype=torch.int64)
    table[layout.tp_rank] = _digest(tensors)
    if layout.tp_size > 1:
        layout.tp.all_reduce(table, "sum", label="tp input digests")
    return table.tolist()


def check_tp_inputs_agree(tensors: Iterable[torch.Tensor], what: str = "the inputs") -> None:
    """Raise ``TPInputMismatchError`` on every rank of the TP group if its ranks passed different
    ``tensors`` (shapes, dtypes or values); one all-reduce of one int64 per TP rank. No-op at tp_size 1."""
    layout = tensor_parallel()
    if layout.tp_size == 1:
        return
    digests = tp_digests(tensors)
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise TPInputMismatchError(
            f"{what} differ between the ranks of one tensor-parallel group (TP ranks {differ} differ from TP "
            f"rank 0; group of {layout.tp_size}, data-parallel rank {layout.dp_rank}): TP peers must get the "
            "same batch. Shard the data over the data-parallel group, e.g. DistributedSampler(dataset, "
            "num_replicas=bmt.config['tp_zero_size'], rank=bmt.config['tp_zero_rank']).")
