"""The communicator interface every backend implements, and the handle async ops return."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ...errors import CollectiveMismatchError, CommError, CommTimeoutError, PeerLostError

_E = TypeVar("_E", bound=CommError)

#: Reduction names accepted by every backend.
REDUCE_OPS = ("sum", "avg", "max", "min")
#: Tags of point-to-point transfers are below this (gloo folds them into its own tag space).
MAX_TAG = 1 << 16


class Handle(abc.ABC):
    """An in-flight collective; ``wait()`` completes it or raises ``CommTimeoutError``."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the op completed (GPU backends: until the current stream is ordered after it)."""


class DoneHandle(Handle):
    """Handle of an op that already completed."""

    def wait(self) -> None:
        """Nothing to wait for."""


class Communicator(abc.ABC):
    """One interface for every backend: flat 1-D buffers in, flat buffers out.

    Public methods validate their arguments once here; backends implement the ``_op`` methods.
    ``label`` names what the collective is for (a block's name, a fixed text). It is part of what defines
    the op for the order check, so it must be the same on every rank that runs the op: text that may
    differ by rank (a path) goes in ``collective_purpose``'s detail, which only messages show.
    """

    backend_name: str = "abstract"
    #: The device this backend's collectives read and write, or None where any tensor will do. NCCL reads
    #: device memory only; host tensors given to it (the norms and owner exchanges of ``offload="host"``'s
    #: pinned shards) go through device copies, synchronously (``_staged``).
    device: torch.device | None = None

    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.broken: str | None = None
        self.mismatch: str | None = None  # why ranks disagreed on a collective: every later op says it again
        # The error that broke the group (a timeout, a lost peer): every later op repeats it, since the op
        # that hit it may be one nobody waits on (an async reduce-scatter) and the next op is what the user sees.
        self.failure: CommError | None = None

    # ---- public API -------------------------------------------------------------------------
    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False,
                        label: str = "") -> Handle | None:
        """Gather every rank's ``shard`` into ``out`` (rank r's piece at ``[r*S, (r+1)*S)``)."""
        self._check_usable("all_gather_into", label)
        _check_flat("all_gather_into", out=out, shard=shard)
        if out.numel() != shard.numel() * self.world_size or out.dtype != shard.dtype:
            raise CommError(f"all_gather_into{_at(label)}: out must hold world_size × shard elements of the "
                            f"shard's dtype; got out {tuple(out.shape)} {out.dtype}, shard {tuple(shard.shape)} "
                            f"{shard.dtype}, world size {self.world_size}")
        return self._staged(lambda o, s: self._all_gather_into(o, s, label), async_op, out, shard)

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str = "sum", *,
                            async_op: bool = False, label: str = "") -> Handle | None:
        """Reduce ``full`` across ranks and leave piece ``rank`` of the result in ``out``."""
        self._check_usable("reduce_scatter_into", label)
        _check_flat("reduce_scatter_into", out=out, full=full)
        _check_op(op, ("sum", "avg"))
        if full.numel() != out.numel() * self.world_size or out.dtype != full.dtype:
            raise CommError(f"reduce_scatter_into{_at(label)}: full must hold world_size × out elements of "
                            f"out's dtype; got full {tuple(full.shape)} {full.dtype}, out {tuple(out.shape)} "
                            f"{out.dtype}, world size {self.world_size}")
        return self._staged(lambda o, f: self._reduce_scatter_into(o, f, op, label), async_op, out, full)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   label: str = "") -> Handle | None:
        """Reduce ``tensor`` in place across ranks."""
        self._check_usable("all_reduce", label)
        _check_flat("all_reduce", tensor=tensor)
        _check_op(op, REDUCE_OPS)
        return self._staged(lambda t: self._all_reduce(t, op, label), async_op, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  label: str = "") -> Handle | None:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        self._check_usable("broadcast", label)
        _check_flat("broadcast", tensor=tensor)
        if not 0 <= src < self.world_size:
            raise CommError(f"broadcast{_at(label)}: src {src} is not a rank of a group of {self.world_size}")
        return self._staged(lambda t: self._broadcast(t, src, label), async_op, tensor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                   *, async_op: bool = False, label: str = "") -> Handle | None:
        """Send ``inp``'s pieces to every rank (``in_splits[p]`` elements to rank p, in rank order) and receive
        theirs into ``out`` (``out_splits[p]`` from rank p). Sizes may differ by rank and be zero (uneven:
        expert parallelism's token dispatch); rank p's ``in_splits[q]`` must equal rank q's ``out_splits[p]``."""
        self._check_usable("all_to_all", label)
        _check_flat("all_to_all", out=out, inp=inp)
        out_splits, in_splits = _splits(out_splits, self.world_size, label), _splits(in_splits, self.world_size, label)
        if out_splits[self.rank] != in_splits[self.rank]:
            raise CommError(f"all_to_all{_at(label)}: this rank's piece of its own must be as long coming in as "
                            f"going out; got out_splits {out_splits}, in_splits {in_splits} at rank {self.rank}")
        if sum(out_splits) != out.numel() or sum(in_splits) != inp.numel() or out.dtype != inp.dtype:
            raise CommError(f"all_to_all{_at(label)}: out must hold sum(out_splits) and inp sum(in_splits) elements "
                            f"of one dtype; got out {tuple(out.shape)} {out.dtype} for {out_splits}, inp "
                            f"{tuple(inp.shape)} {inp.dtype} for {in_splits}")
        return self._staged(lambda o, i: self._all_to_all(o, i, out_splits, in_splits, label), async_op, out, inp)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False,
             label: str = "") -> Handle | None:
        """Send ``tensor`` to rank ``dst`` of this group, which takes it with ``recv(..., src=this rank, tag)``.

        Point to point: only the two ranks take part. Sends and receives between two ranks must be posted
        in the same order on both (the pipeline's schedule does); ``tag`` (< 2**16) tells transfers of one
        pair apart (gloo matches on it; NCCL ignores it and matches in order).
        """
        self._check_usable("send", label)
        _check_flat("send", tensor=tensor)
        self._check_peer("send", dst, tag, label)
        return self._staged(lambda t: self._send(t, dst, tag, label), async_op, tensor)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False,
             label: str = "") -> Handle | None:
        """Receive into ``tensor`` what rank ``src`` of this group sent with ``tag``; sizes and dtypes must match."""
        self._check_usable("recv", label)
        _check_flat("recv", tensor=tensor)
        self._check_peer("recv", src, tag, label)
        return self._staged(lambda t: self._recv(t, src, tag, label), async_op, tensor)

    def _check_peer(self, what: str, peer: int, tag: int, label: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or (peer == self.rank and self.world_size > 1):
            raise CommError(f"{what}{_at(label)}: peer {peer!r} is not another rank of the {self.describe()}")
        if not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
            raise CommError(f"{what}{_at(label)}: tag {tag!r} must be an int in [0, {MAX_TAG})")

    def barrier(self, label: str = "") -> None:
        """Return once every rank reached this barrier."""
        self._check_usable("barrier", label)
        self._finish(self._barrier(label), async_op=False)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the backend's own threads before its process group goes; False if one is stuck."""
        return True

    @property
    def process_group(self) -> Any:
        """The torch process group this communicator runs on, or None (CuPy NCCL, one process)."""
        group = getattr(self, "_group", None)
        return group() if callable(group) else group  # the torch backends hold it weakly (subgroups.GroupRef)

    def subgroup(self, ranks: Sequence[int], group: Any = None) -> Communicator:
        """A communicator over ``ranks`` (ranks of this communicator, this one among them), the same backend
        carried by ``group`` (torch's process group of exactly those ranks; backends without one ignore it).

        Every rank of ``ranks`` must call it, in the same order as its other sub-group creations (NCCL
        exchanges an id); backends give a group of one rank the single-process communicator.
        """
        ranks = tuple(int(r) for r in ranks)
        if self.rank not in ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise CommError(f"subgroup{ranks}: ranks must be distinct ranks of the {self.describe()} and include "
                            "this one")
        return self._subgroup(ranks, group)

    def runs_after(self, other: Communicator) -> bool:
        """True when an op posted here after an op posted on ``other`` is guaranteed to start after that one
        finished (one FIFO worker for both); False by default: wait for it first."""
        return False

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        raise CommError(f"the {self.backend_name} backend has no sub-group communicators")

    def describe(self) -> str:
        """A short description of the group for error messages."""
        return f"{self.backend_name} group of {self.world_size} rank(s), this is rank {self.rank}"

    def timeout_error(self, what: str) -> CommTimeoutError:
        """Build the fatal timeout error for ``what`` and mark this communicator unusable."""
        self.broken = what
        return self._first_failure(CommTimeoutError(
            f"{what} did not complete within {self.timeout.total_seconds():.0f}s on the {self.describe()}. "
            "Usually another rank died or stopped calling collectives (it left a loop early: a different "
            "number of batches or generated tokens per rank), or, on GPU, ranks called different "
            "collectives (BMT_WRAP_DEBUG=1 names them). The process group is unusable "
            "after this: restart the job (torchrun restarts it with --max-restarts)."))

    def peer_lost_error(self, what: str, detail: str, peer: int | None = None) -> PeerLostError:
        """Build the fatal error for a peer that left during ``what`` and mark this communicator unusable.

        ``peer`` is the lost one's rank in this group when the failed transfer was with one rank; with two
        ranks it can only be the other one.
        """
        if peer is None and self.world_size == 2:
            peer = 1 - self.rank
        who = "another rank" if peer is None else f"rank {self.global_rank(peer)}"
        self.broken = what
        return self._first_failure(PeerLostError(
            f"{what} failed on the {self.describe()}: {who} closed its connection ({detail.strip()[:200]}). "
            f"It died, timed out first or tore its group down: look at {who}'s output for the first "
            "error. The process group is unusable after this: restart the job (torchrun --max-restarts)."))

    def _first_failure(self, error: _E) -> _E:
        """``error``, kept as the group's failure unless an earlier one broke it first (that one is the cause)."""
        if self.failure is None:
            self.failure = error
        return error

    def global_rank(self, rank: int) -> int:
        """The job's rank of this group's ``rank`` (what each rank's log lines are prefixed with)."""
        return rank

    # ---- backend hooks --------------------------------------------------------------------------
    @abc.abstractmethod
    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle: ...

    @abc.abstractmethod
    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle: ...

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle: ...

    @abc.abstractmethod
    def _barrier(self, label: str) -> Handle: ...

    @abc.abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle: ...

    @abc.abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle: ...

    @abc.abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle: ...

    # ---- helpers ----------------------------------------------------------------------------------
    def _check_usable(self, what: str, label: str) -> None:
        if self.broken is not None:
            raise self.unusable_error(f"{what}{_at(label)}")

    def unusable_error(self, what: str) -> CommError:
        """The error for ``what`` on a group an earlier failure broke: the mismatch itself when ranks
        disagreed (so every rank reports the divergence, whichever op it waits on first), else that failure
        again, of its type (a lost peer stays a ``PeerLostError`` naming the peer)."""
        if self.mismatch is not None:
            return CollectiveMismatchError(self.mismatch)
        if self.failure is not None:
            return type(self.failure)(f"{what} was not run: the {self.describe()} is unusable after an earlier "
                                      f"failure. {self.failure}")
        return CommTimeoutError(f"{what}: the {self.describe()} is unusable after an earlier failure "
                                f"({self.broken}); restart the job.")

    def _staged(self, launch: Callable[..., Handle], async_op: bool, written: torch.Tensor,
                *read: torch.Tensor) -> Handle | None:
        """``launch(written, *read)``, finished as ``async_op`` asks. Where the backend needs its tensors on
        ``self.device`` and some are elsewhere, it runs on device copies and ``written`` gets the result
        before this returns (an async op's handle is then already complete)."""
        tensors = (written, *read)
        if self.device is None or all(t.device == self.device for t in tensors):
            return self._finish(launch(*tensors), async_op)
        moved = [t if t.device == self.device else t.to(self.device) for t in tensors]
        launch(*moved).wait()  # stream-ordered: the copy back below runs after the collective
        if moved[0] is not written:
            written.copy_(moved[0])  # to host memory: returns once the copy is done
        return self._finish(DoneHandle(), async_op)

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle | None:
        if async_op:
            return handle
        handle.wait()
        return None


class CommunicatorWrapper(Communicator):
    """Base of wrappers (counting, fingerprinting): timeout and failure state live in the wrapped backend."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.backend_name = inner.backend_name

    @property  # type: ignore[override]
    def timeout(self) -> timedelta:
        """The wrapped backend's timeout."""
        return self.inner.timeout

    @timeout.setter
    def timeout(self, value: timedelta) -> None:
        self.inner.timeout = value

    @property  # type: ignore[override]
    def broken(self) -> str | None:
        """Why the wrapped backend became unusable, or None."""
        return self.inner.broken

    @broken.setter
    def broken(self, value: str | None) -> None:
        self.inner.broken = value

    @property  # type: ignore[override]
    def mismatch(self) -> str | None:
        """The wrapped backend's collective mismatch, or None."""
        return self.inner.mismatch

    @mismatch.setter
    def mismatch(self, value: str | None) -> None:
        self.inner.mismatch = value

    @property  # type: ignore[override]
    def failure(self) -> CommError | None:
        """The error that broke the wrapped backend, or None."""
        return self.inner.failure

    @failure.setter
    def failure(self, value: CommError | None) -> None:
        self.inner.failure = value

    def global_rank(self, rank: int) -> int:
        """The wrapped backend's answer."""
        return self.inner.global_rank(rank)

    @property  # type: ignore[override]
    def device(self) -> torch.device | None:
        """The device the wrapped backend's collectives need their tensors on (None: any)."""
        return self.inner.device

    def describe(self) -> str:
        """The wrapped backend's description."""
        return self.inner.describe()

    @property
    def process_group(self) -> Any:
        """The wrapped backend's torch process group."""
        return self.inner.process_group

    def runs_after(self, other: Communicator) -> bool:
        """The wrapped backends' answer (wrappers post in call order, on the calling thread)."""
        while isinstance(other, CommunicatorWrapper):
            other = other.inner
        return self.inner.runs_after(other)


def _at(label: str) -> str:
    return f" for {label!r}" if label else ""


def _check_flat(what: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CommError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or not t.is_contiguous():
            raise CommError(f"{what}: {name} must be a contiguous 1-D tensor (flatten it first); "
                            f"got shape {tuple(t.shape)}, contiguous={t.is_contiguous()}")


def _splits(splits: Sequence[int], world_size: int, label: str) -> list[int]:
    """``splits`` as a list of one non-negative int per rank, or ``CommError``."""
    out = [int(s) for s in splits]
    if len(out) != world_size or any(s < 0 for s in out):
        raise CommError(f"all_to_all{_at(label)}: splits must be {world_size} non-negative sizes (one per rank), "
                        f"got {list(splits)}")
    return out


def split_offsets(splits: list[int]) -> list[int]:
    """Where each rank's piece starts in a buffer cut by ``splits``."""
    starts = [0]
    for s in splits[:-1]:
        starts.append(starts[-1] + s)
    return starts


def _check_op(op: str, allowed: tuple[str, ...]) -> None:
    if op not in allowed:
        raise CommError(f"unsupported reduce op {op!r}; use one of {allowed}")
