"""The checks that ranks which take the same slice of the data were given the same batch: the ranks of
one tensor-parallel group, and the stages of one pipeline (``bmt.data_parallel_rank()``).

TP peers compute one model replica together, and the stages of a pipeline run its parts one after another,
so each must see the same inputs; a data loader sharded over the whole world instead of over the
data-parallel ranks gives them different batches and trains on garbage without any error. One all-reduce
of a digest per rank over the group finds it, and every rank of the group raises the same error
(``TPInputMismatchError``, ``PipelineInputMismatchError``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from ..errors import PipelineInputMismatchError, TPInputMismatchError
from ..runtime.comm import Communicator
from .distributed import parallel_layout


def _digest(tensors: Iterable[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        data = t.detach().contiguous().cpu()
        crc = zlib.crc32(repr((tuple(data.shape), str(data.dtype))).encode(), crc)
        crc = zlib.crc32(data.view(torch.uint8).reshape(-1).numpy().tobytes() if data.numel() else b"", crc)
    return crc


def digests(comm: Communicator, tensors: Iterable[torch.Tensor], label: str) -> list[int]:
    """Every rank of ``comm``'s digest of its ``tensors`` (shapes, dtypes, values): one all-reduce."""
    table = torch.zeros(comm.world_size, dtype=torch.int64)
    table[comm.rank] = _digest(tensors)
    if comm.world_size > 1:
        comm.all_reduce(table, "sum", label=label)
    return table.tolist()


def tp_digests(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Every TP rank's digest of its ``tensors`` (shapes, dtypes, values): one all-reduce over the TP group."""
    return digests(parallel_layout().tp, tensors, "tp input digests")


def check_pipeline_inputs_agree(tensors: Iterable[torch.Tensor], what: str = "the inputs") -> None:
    """Raise ``PipelineInputMismatchError`` on every stage of a pipeline whose stages passed different
    ``tensors``; one all-reduce of one int64 per stage. No-op without pipeline parallelism."""
    layout = parallel_layout()
    if layout.pp is None:
        return
    raise_if_stages_differ(digests(layout.pp, tensors, "pipeline input digests"), what, layout.dp_rank)


def raise_if_stages_differ(seen: list[int], what: str, dp_rank: int) -> None:
    """Raise ``PipelineInputMismatchError`` if the stages' input digests ``seen`` (by stage) differ."""
    if len(set(seen)) > 1:
        differ = [s for s, d in enumerate(seen) if d != seen[0]]
        raise PipelineInputMismatchError(
            f"{what} differ between the stages of one pipeline (stages {differ} differ from stage 0; data-parallel "
            f"rank {dp_rank}): every stage of a pipeline must get the same batch. Shard the data over the "
            "data-parallel ranks: DistributedSampler(dataset, num_replicas=bmt.data_parallel_size(), "
            "rank=bmt.data_parallel_rank()).")


def check_tp_inputs_agree(tensors: Iterable[torch.Tensor], what: str = "the inputs") -> None:
    """Raise ``TPInputMismatchError`` on every rank of the TP group if its ranks passed different
    ``tensors`` (shapes, dtypes or values); one all-reduce of one int64 per TP rank. No-op at tp_size 1."""
    layout = parallel_layout()
    if layout.tp_size == 1:
        return
    seen = tp_digests(tensors)
    if len(set(seen)) > 1:
        differ = [r for r, d in enumerate(seen) if d != seen[0]]
        raise TPInputMismatchError(
            f"{what} differ between the ranks of one tensor-parallel group (TP ranks {differ} differ from TP "
            f"rank 0; group of {layout.tp_size}, data-parallel rank {layout.dp_rank}): TP peers must get the "
            "same batch. Shard the data over the data-parallel group, e.g. DistributedSampler(dataset, "
            "num_replicas=bmt.config['tp_zero_size'], rank=bmt.config['tp_zero_rank']).")
