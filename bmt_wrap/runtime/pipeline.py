"""Pipeline stages at run time: activations between stages as autograd Functions, and where a stage's
parameters live (docs/design.md, "Pipeline parallelism").

Between two stages travel lists of tensors, each transfer a small header first (count, then per tensor
its dtype, whether it requires grad, and its shape) and then the tensors, point to point over the pipe
group. ``SendActivations`` sends a micro-batch's activations forward and, in backward, receives their
gradients; ``RecvActivations`` is its other end. Each carries the micro-batch index, so gloo tells the
transfers of one pair apart by tag, and the order check names both sides when stages disagree.

Where stages are cut is decided by the pure pass (``passes/pipeline.py``); this module only moves data.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PipelineError
from .comm import Communicator

#: Ints in a transfer's header: the tensor count, then per tensor dtype, requires_grad, ndim and the dims.
HEADER_INTS = 64
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64)
_FORWARD, _BACKWARD = 0, 1


def forward_tag(micro: int) -> int:
    """The tag of micro-batch ``micro``'s activations."""
    return tag_of(micro, _FORWARD)


def tag_of(micro: int, direction: int) -> int:
    """The transfer tag of micro-batch ``micro``'s activations (``direction`` 0) or gradients (1)."""
    return (2 * micro + direction) % (1 << 16)


def encode_header(tensors: Sequence[torch.Tensor], requires_grad: Sequence[bool] | None = None) -> torch.Tensor:
    """The header describing ``tensors`` (``PipelineError`` when it does not fit ``HEADER_INTS``)."""
    header = [len(tensors)]
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise PipelineError(f"a pipeline stage cannot send a {t.dtype} tensor; use one of {_DTYPES}")
        grad = t.requires_grad if requires_grad is None else requires_grad[i]
        header += [_DTYPES.index(t.dtype), int(grad), t.dim(), *t.shape]
    if len(header) > HEADER_INTS:
        raise PipelineError(f"a pipeline stage's output of {len(tensors)} tensors with shapes "
                            f"{[tuple(t.shape) for t in tensors]} needs more than {HEADER_INTS} header ints: "
                            "return fewer tensors from the last block of a stage")
    return torch.tensor(header + [0] * (HEADER_INTS - len(header)), dtype=torch.int64)


#: A header whose count is this says the sender's forward failed: no tensors follow.
FAILED = -1


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """(dtype, requires_grad, shape) of each tensor a header describes; ``StageFailed`` for a failure's."""
    values = header.tolist()
    if values[0] == FAILED:
        raise StageFailed("the previous pipeline stage failed in its forward (its rank raised the error)")
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, grad, ndim = values[pos:pos + 3]
        out.append((_DTYPES[dtype], bool(grad), tuple(values[pos + 3:pos + 3 + ndim])))
        pos += 3 + ndim
    return out


class StageFailed(PipelineError):
    """What a stage receives in place of activations when the stage before it failed."""


def send_failure(comm: Communicator, dst: int, tag: int, label: str, device: torch.device | str = "cpu") -> None:
    """Tell rank ``dst`` that this stage's forward failed, where it expects a transfer (no tensors follow)."""
    header = torch.zeros(HEADER_INTS, dtype=torch.int64, device=device)
    header[0] = FAILED
    comm.send(header, dst, tag=tag, label=f"{label} header")


def drain(comm: Communicator, src: int, tag: int, label: str, device: torch.device | str = "cpu") -> None:
    """Receive and drop what rank ``src`` sends with ``send_tensors`` (or ``send_failure``): a stage that
    failed still takes its inputs, so the stage before it never waits for a receiver that left."""
    try:
        recv_tensors(comm, src, tag, label, device)
    except StageFailed:
        pass


#: Seconds this process spent in transfers between stages (waiting for a peer, or moving data) since the
#: last ``reset_transfer_time``: a stage's idle time, what a schedule's bubble costs (benchmarks/pipeline.py).
_TRANSFER_SECONDS = [0.0]


def transfer_time() -> float:
    """Seconds spent in transfers between stages since ``reset_transfer_time``."""
    return _TRANSFER_SECONDS[0]


def reset_transfer_time() -> None:
    """Start counting ``transfer_time`` again."""
    _TRANSFER_SECONDS[0] = 0.0


#: Each action the last ``pipeline_step`` ran on this rank, in order: (kind: torch's "F", "B", "I" or "W", stage,
#: micro-batch, the action's thread CPU seconds). CPU time is what the stage computed, whatever else shares
#: the cores: benchmarks/pipeline.py replays the schedule with it, for the idle time on dedicated cores.
_ACTIONS: list[tuple[str, int, int, float]] = []


def action_times() -> list[tuple[str, int, int, float]]:
    """The actions the last ``pipeline_step`` ran on this rank, in order, with their thread CPU seconds."""
    return list(_ACTIONS)


def clear_action_times() -> None:
    """Empty ``action_times``: a ``pipeline_step`` starts (the log holds one step, not a run's)."""
    _ACTIONS.clear()


def record_action(kind: str, stage: int, micro: int, cpu_seconds: float) -> None:
    """Log one schedule action's thread CPU time (``action_times``)."""
    _ACTIONS.append((kind, stage, micro, cpu_seconds))


def count_transfer_time(seconds: float) -> None:
    """Add ``seconds`` a stage waited for its peers outside these transfers (a torch schedule's own)."""
    _TRANSFER_SECONDS[0] += seconds


def send_tensors(comm: Communicator, tensors: Sequence[torch.Tensor], dst: int, tag: int, label: str,
                 requires_grad: Sequence[bool] | None = None) -> None:
    """Send a header, then each tensor, to rank ``dst`` of ``comm``."""
    start = time.perf_counter()
    device = tensors[0].device if tensors else torch.device("cpu")
    comm.send(encode_header(tensors, requires_grad).to(device), dst, tag=tag, label=f"{label} header")
    for t in tensors:
        comm.send(t.detach().contiguous().reshape(-1), dst, tag=tag, label=label)
    _TRANSFER_SECONDS[0] += time.perf_counter() - start


def recv_tensors(comm: Communicator, src: int, tag: int, label: str,
                 device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, bool]]:
    """Receive what ``send_tensors`` sent from rank ``src`` of ``comm``: each tensor and its requires_grad."""
    start = time.perf_counter()
    header = torch.empty(HEADER_INTS, dtype=torch.int64, device=device)
    try:
        comm.recv(header, src, tag=tag, label=f"{label} header")
        out = []
        for dtype, grad, shape in decode_header(header):
            t = torch.empty(shape, dtype=dtype, device=device)
            comm.recv(t.view(-1), src, tag=tag, label=label)
            out.append((t, grad))
        return out
    finally:
        _TRANSFER_SECONDS[0] += time.perf_counter() - start


@dataclass(frozen=True)
class Hop:
    """One stage boundary as a rank sees it: the pipe group, the peer stage, the micro-batch and a label."""

    comm: Communicator
    peer: int
    micro: int
    label: str


class SendActivations(torch.autograd.Function):
    """Forward: send ``tensors`` to the next stage, return a token (an empty tensor) that joins this rank's
    graph to the next stage's. Backward: receive the gradients of the tensors that require one."""

    @staticmethod
    def forward(ctx: Any, hop: Hop, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.hop = hop
        ctx.needs = [t.requires_grad for t in tensors]
        send_tensors(hop.comm, tensors, hop.peer, tag_of(hop.micro, _FORWARD), hop.label)
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx: Any, token_grad: torch.Tensor) -> tuple[Any, ...]:
        hop = ctx.hop
        got = iter(recv_tensors(hop.comm, hop.peer, tag_of(hop.micro, _BACKWARD), f"{hop.label} gradients",
                                token_grad.device))
        return (None, *[next(got)[0] if need else None for need in ctx.needs])


class RecvActivations(torch.autograd.Function):
    """Forward: receive the previous stage's tensors (those it sent requiring grad come back requiring it).
    Backward: send their gradients (zeros where none arrived) to the previous stage."""

    @staticmethod
    def forward(ctx: Any, hop: Hop, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hop = hop
        got = recv_tensors(hop.comm, hop.peer, tag_of(hop.micro, _FORWARD), hop.label, anchor.device)
        ctx.needs = [grad for _, grad in got]
        ctx.mark_non_differentiable(*[t for t, grad in got if not grad])
        return tuple(t for t, _ in got)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        hop = ctx.hop
        sent = [g for g, need in zip(grads, ctx.needs, strict=True) if need]
        send_tensors(hop.comm, sent, hop.peer, tag_of(hop.micro, _BACKWARD), f"{hop.label} gradients")
        return None, None


def anchor(device: torch.device | str) -> torch.Tensor:
    """A leaf that requires grad, so a ``RecvActivations`` node joins the graph even when nothing it
    receives came from a parameter of this rank."""
    return torch.empty(0, device=device, requires_grad=True)


def broadcast_tensors(comm: Communicator, tensors: Sequence[torch.Tensor] | None, src: int, label: str,
                      device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Rank ``src``'s ``tensors`` on every rank of ``comm`` (a header, then each tensor); others pass None."""
    start = time.perf_counter()
    header = encode_header(tensors).to(device) if tensors is not None else \
        torch.empty(HEADER_INTS, dtype=torch.int64, device=device)
    comm.broadcast(header, src, label=f"{label} header")
    out = []
    for i, (dtype, _, shape) in enumerate(decode_header(header)):
        t = tensors[i].detach().contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        comm.broadcast(t.view(-1), src, label=label)
        out.append(t)
    _TRANSFER_SECONDS[0] += time.perf_counter() - start
    return out


@dataclass(frozen=True)
class Ends:
    """A pipeline's two ends as a rank sees them: the pipe group, its first and last stage, a label."""

    comm: Communicator
    label: str

    @property
    def first(self) -> bool:
        """True on the first stage."""
        return self.comm.rank == 0

    @property
    def last(self) -> bool:
        """True on the last stage."""
        return self.comm.rank == self.comm.world_size - 1


class ShareOutput(torch.autograd.Function):
    """The last stage's outputs on every stage (one broadcast over the pipe group), each stage's backward
    driven from there: the last stage passes the gradients on to its outputs; the other stages ignore
    theirs (the last stage's are the ones that count) and start their own part of the backward through
    ``parts``, the tokens of their sends (``SendActivations``) and the input's (``ShareInputGrads``).

    ``apply(ends, n_out, *outputs_then_parts)``: the last stage passes its ``n_out`` outputs first, the
    others nothing there (``n_out`` 0)."""

    @staticmethod
    def forward(ctx: Any, ends: Ends, n_out: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs, parts = tensors[:n_out], tensors[n_out:]
        ctx.n_out, ctx.parts = n_out, [(p.shape, p.dtype, p.device) for p in parts]
        device = parts[0].device if parts else outputs[0].device
        shared = broadcast_tensors(ends.comm, list(outputs) if ends.last else None, ends.comm.world_size - 1,
                                   f"{ends.label} output", device)
        out = tuple(t.view_as(t) if ends.last else t for t in shared)
        ctx.mark_non_differentiable(*[t for t in out if not (t.is_floating_point() or t.is_complex())])
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        parts = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.parts]
        return (None, None, *grads[:ctx.n_out], *parts)


class ShareInputGrads(torch.autograd.Function):
    """The identity on a pipeline's inputs, whose backward makes their gradients what one process would
    compute: ``flowing`` inputs (the first stage computes from them, the others receive its activations)
    take the first stage's gradient, broadcast over the pipe group; the other inputs, which every stage's
    blocks read, take the sum of every stage's part (one all-reduce)."""

    @staticmethod
    def forward(ctx: Any, ends: Ends, flowing: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.ends, ctx.flowing = ends, flowing
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ends = ctx.ends
        out = []
        for i, g in enumerate(grads):
            g = g.contiguous()
            if i < ctx.flowing:
                ends.comm.broadcast(g.view(-1), 0, label=f"{ends.label} input gradient")
            else:
                ends.comm.all_reduce(g.view(-1), "sum", label=f"{ends.label} argument gradient")
            out.append(g)
        return (None, None, *out)
