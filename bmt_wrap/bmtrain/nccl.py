"""BMTrain's ``bmt.nccl`` calls on bmt_wrap's communicator (gloo on CPU, NCCL on GPUs).

Buffers are ``tensor.storage()`` objects as in BMTrain, or tensors. The calls are synchronous: they
return when the collective completed, so ``groupStart``/``groupEnd`` only mark a region. Making NCCL
communicators by hand (``getUniqueId``, ``commInitRank``) and point-to-point ``send``/``recv``
(pipeline parallelism) are not supported: there is one communicator per job, ``bmt.config["comm"]``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CommError, UnsupportedError
from ..job.collectives import communicator, reduce_
from ..runtime.comm import Communicator

NCCLCommunicator = Communicator  # what BMTrain's signatures name; ``bmt.config["comm"]`` is one


def _tensor(buf: Any, what: str) -> torch.Tensor:
    """A flat tensor over the storage (or tensor) ``buf``, sharing its memory."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise CommError(f"{what} must be contiguous")
        return buf.view(-1)
    if isinstance(buf, torch.TypedStorage):
        return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf)
    if isinstance(buf, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf)
    raise CommError(f"{what} must be a tensor or a tensor's storage(), got {type(buf).__name__}")


def _pair(src: Any, dst: Any) -> tuple[torch.Tensor, torch.Tensor]:
    s, d = _tensor(src, "src"), _tensor(dst, "dst")
    if s.dtype != d.dtype or s.device != d.device:
        raise CommError(f"src and dst must have one dtype and device; got {s.dtype} on {s.device} and "
                        f"{d.dtype} on {d.device}")
    return s, d


def _same_size(s: torch.Tensor, d: torch.Tensor, factor_src: int = 1, factor_dst: int = 1) -> None:
    if s.numel() * factor_src != d.numel() * factor_dst:
        raise CommError(f"buffer sizes do not fit: src holds {s.numel()} elements, dst {d.numel()}")


def commCount(comm: Communicator) -> int:  # noqa: N802 - BMTrain's name
    """Number of ranks of ``comm``."""
    return communicator(comm).world_size


def commRank(comm: Communicator) -> int:  # noqa: N802 - BMTrain's name
    """This process's rank in ``comm``."""
    return communicator(comm).rank


def allReduce(src: Any, dst: Any, op: str, comm: Communicator) -> None:  # noqa: N802 - BMTrain's name
    """``dst`` = ``src`` reduced over ranks with ``op``; ``src`` may be ``dst`` (in place)."""
    s, d = _pair(src, dst)
    _same_size(s, d)
    if d.data_ptr() != s.data_ptr():
        d.copy_(s)
    reduce_(d, op, communicator(comm))


def reduce(src: Any, dst: Any, op: str, root: int, comm: Communicator) -> None:
    """``dst`` on rank ``root`` = ``src`` reduced over ranks (other ranks' ``dst`` get it too)."""
    c = communicator(comm)
    if not 0 <= root < c.world_size:
        raise CommError(f"root {root} is not a rank of a group of {c.world_size}")
    allReduce(src, dst, op, c)


def broadcast(src: Any, dst: Any, root: int, comm: Communicator) -> None:
    """``dst`` on every rank = ``src`` of rank ``root``."""
    s, d = _pair(src, dst)
    _same_size(s, d)
    c = communicator(comm)
    if c.rank == root and d.data_ptr() != s.data_ptr():
        d.copy_(s)
    c.broadcast(d, root, label="bmt.nccl.broadcast")


def allGather(src: Any, dst: Any, comm: Communicator) -> None:  # noqa: N802 - BMTrain's name
    """``dst`` = every rank's ``src`` one after another (``dst`` holds world_size × ``src``)."""
    s, d = _pair(src, dst)
    c = communicator(comm)
    _same_size(s, d, factor_src=c.world_size)
    c.all_gather_into(d, s.clone() if d.data_ptr() == s.data_ptr() else s, label="bmt.nccl.allGather")


def reduceScatter(src: Any, dst: Any, op: str, comm: Communicator) -> None:  # noqa: N802 - BMTrain's name
    """``dst`` = piece ``rank`` of ``src`` reduced over ranks (``src`` holds world_size × ``dst``)."""
    s, d = _pair(src, dst)
    c = communicator(comm)
    _same_size(s, d, factor_dst=c.world_size)
    if op in ("sum", "avg"):
        c.reduce_scatter_into(d, s, op, label="bmt.nccl.reduceScatter")
        return
    full = s.clone()
    reduce_(full, op, c)
    d.copy_(full[c.rank * d.numel():(c.rank + 1) * d.numel()])


def groupStart() -> None:  # noqa: N802 - BMTrain's name
    """Start of a group of calls: nothing to do, each call here completes before it returns."""


def groupEnd() -> None:  # noqa: N802 - BMTrain's name
    """End of a group of calls (see ``groupStart``)."""


def _unsupported(name: str) -> UnsupportedError:
    return UnsupportedError(f"bmt.nccl.{name} is not supported: bmt_wrap has one communicator per job "
                            "(bmt.config['comm']) and no pipeline parallelism, so it makes no NCCL handles "
                            "and sends no activations point to point")


def getUniqueId() -> bytes:  # noqa: N802 - BMTrain's name
    """Not supported: there is one communicator per job, ``bmt.config["comm"]``."""
    raise _unsupported("getUniqueId")


def commInitRank(unique_id: bytes, world_size: int, rank: int) -> Communicator:  # noqa: N802 - BMTrain's name
    """Not supported: use ``bmt.config["comm"]``."""
    raise _unsupported("commInitRank")


def send(src: Any, peer: int, comm: Communicator) -> None:
    """Not supported (pipeline parallelism)."""
    raise _unsupported("send")


def recv(dst: Any, peer: int, comm: Communicator) -> None:
    """Not supported (pipeline parallelism)."""
    raise _unsupported("recv")
