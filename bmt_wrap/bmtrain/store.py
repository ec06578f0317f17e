"""BMTrain's ``bmtrain.store`` module: ``save``/``load`` and Python objects across ranks."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..job.collectives import communicator, gather_flat
from ..job.distributed import broadcast_bytes
from ..runtime.comm import Communicator
from ..save_load import load, save

__all__ = ["allgather_object", "allgather_objects", "broadcast_object", "load", "save"]


def allgather_object(obj: Any, comm: Communicator | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank; a collective."""
    c = communicator(comm)
    if c.world_size == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = gather_flat(torch.tensor([data.numel()], dtype=torch.int64), c).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = gather_flat(padded, c)
    return [pickle.loads(gathered[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def allgather_objects(obj: Any) -> list[Any]:
    """BMTrain's other spelling of ``allgather_object`` (on the job's communicator)."""
    return allgather_object(obj)


def broadcast_object(obj: Any, comm: Communicator | None = None, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank; a collective."""
    c = communicator(comm)
    data = pickle.dumps(obj) if c.rank == src else None
    return pickle.loads(broadcast_bytes(data, src))
