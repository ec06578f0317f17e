"""What defines a collective for the order check, and the hint that fits when ranks disagree on one.

An op is defined by its kind, size, dtype, root or reduction, its label (a block's name or a fixed text,
the same on every rank that runs the op) and the call it runs in (``collective_purpose``: ``bmt.save``,
wrapping, ...; none while the model runs). What the user passed to that call (a path) only appears in
messages: ``bmt.save(model, f"model_rank{rank}.safetensors")`` runs the same collectives on every rank,
so the ranks must agree, whatever the paths say. (A call that needs one path on every rank, such as a
sharded save into one directory, checks that itself and says so.)
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

RECORD_BYTES = 128  # an op's description as ranks exchange it: key, then the call's name and the text
_KEY_BYTES = 8


class _Call(NamedTuple):
    shown: str  # how messages name the call
    note: str  # what may differ between ranks in it, and what may not


_CALLS = {
    "wrap": _Call("BMTrainModelWrapper", "every rank must wrap the same model with the same arguments"),
    "block": _Call("CheckpointBlock", "every rank must build the same blocks in the same order"),
    "save": _Call("bmt.save", "only rank 0 writes the file, so the path may differ by rank, but every rank "
                              "must pass the same model"),
    "load": _Call("bmt.load", "each rank reads its own slices, so the path may differ by rank when every "
                              "rank's file holds the same checkpoint, but every rank must pass the same model"),
    "save_checkpoint": _Call("bmt.save_checkpoint", "every rank must pass the same model and optimizer, and one "
                                                    "directory"),
    "load_checkpoint": _Call("bmt.load_checkpoint", "the directory may differ by rank when every rank's copy holds "
                                                    "the same checkpoint, but every rank must pass the same model "
                                                    "and optimizer"),
    "save_directory": _Call("checkpoint.dcp.save_directory", "every rank must pass the same state, and one "
                                                             "directory"),
}

_RUNNING = ("A block was skipped or repeated on some ranks, or the ranks ran different numbers of forwards, "
            "backwards or optimizer steps: control flow around blocks (layer drop, experts, optional inputs) and "
            "the number of steps (uneven data per rank: drop_last=True) must be the same on every rank.")


@dataclass(frozen=True)
class Purpose:
    """The call collectives are issued in (a key of ``_CALLS``; "" while the model runs) and its path."""

    call: str = ""
    detail: str = ""


_current = Purpose()


@contextmanager
def collective_purpose(call: str, detail: str = "") -> Iterator[None]:
    """Collectives issued inside belong to ``call`` (``"save"``, ``"wrap"`` ...) on ``detail`` (a path)."""
    global _current
    if call not in _CALLS:
        raise ValueError(f"unknown collective purpose {call!r}; one of {sorted(_CALLS)}")
    outer, _current = _current, Purpose(call, detail)
    try:
        yield
    finally:
        _current = outer


@dataclass(frozen=True)
class OpDescription:
    """One op as the order check sees it: ``key`` defines it, ``call`` and ``text`` explain it. ``tag``
    tells its data transfers apart from other ops' and ignores the call, so that ranks in different calls
    can still exchange their descriptions (the debug fingerprint) after the check."""

    key: bytes
    call: str
    text: str
    tag: int = 0

    def encode(self) -> torch.Tensor:
        """The fixed-size record peers exchange (the text is cut to fit)."""
        raw = (self.key + f"{self.call}\n{self.text}".encode())[:RECORD_BYTES]
        record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        record[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return record

    @staticmethod
    def decode(record: torch.Tensor) -> OpDescription:
        """The description a peer sent."""
        raw = record.cpu().numpy().tobytes()
        call, _, text = raw[_KEY_BYTES:].rstrip(bytes(1)).decode(errors="replace").partition("\n")
        return OpDescription(raw[:_KEY_BYTES], call, text)


def describe_op(op: str, tensor: torch.Tensor | None, label: str, arg: str | int = "") -> OpDescription:
    """Describe ``op`` on ``tensor`` (``arg``: its root or reduction) in the current call."""
    purpose = _current
    call = _CALLS.get(purpose.call)
    shape = f"({tensor.numel()} x {tensor.dtype}{f', {arg}' if arg != '' else ''})" if tensor is not None else ""
    op_only = f"{op}{shape} {label!r}"
    text = f"{op}{shape}{f' for {label!r}' if label else ''}"
    if call is not None:
        text += f" in {call.shown}({purpose.detail!r})" if purpose.detail else f" in {call.shown}"
    key = hashlib.blake2b(f"{op_only} {purpose.call}".encode(), digest_size=_KEY_BYTES).digest()
    return OpDescription(key, purpose.call, text, zlib.crc32(op_only.encode()))


def mismatch_message(sequence: int, sides: dict[int, OpDescription]) -> str:
    """Why ranks disagree on collective ``sequence`` (each rank's op in ``sides``) and what fits the fix."""
    listed = "; ".join(f"rank {r}: {d.text}" for r, d in sorted(sides.items()))
    calls = list(dict.fromkeys(d.call for _, d in sorted(sides.items())))
    if calls == [""]:
        hint = _RUNNING
        reducing = {d.text.startswith("reduce_scatter") for d in sides.values()}
        if len(reducing) == 2:  # gradients reduced on some ranks only
            hint += (" A gradient reduce-scatter ran on some ranks only: if some ranks ran a backward inside "
                     "model.no_sync() and others outside it, enter no_sync on every rank alike.")
    elif len(calls) == 1:
        call = _CALLS[calls[0]]
        hint = f"Every rank was in {call.shown}, but they ran different collectives: {call.note}."
    else:
        where = ", ".join(f"rank {r} was {'in ' + _CALLS[d.call].shown if d.call else 'running the model'}"
                          for r, d in sorted(sides.items()))
        hint = f"{where[0].upper()}{where[1:]}. " + " ".join(
            f"{_CALLS[c].shown} is a collective: every rank must call it at the same point, never under "
            f"`if rank == 0`; {_CALLS[c].note}." for c in calls if c)
    return f"collective #{sequence} differs across ranks ({listed}). {hint}"
