"""CRC-32s of checkpoints: computed while a save writes them, checked at load, so a flipped bit is a named
error instead of silently wrong weights (issue 38: training turned to NaN within 4 steps). zlib's CRC-32
runs at ~2.7 GB/s on one core here, about a disk's read speed.

A sharded checkpoint records each file's CRC-32 in its ``metadata.json`` (``AtomicFile(checksum=True)``).
A consolidated file (``bmt.save``) has no file beside it, so it carries one CRC-32 per tensor inside: a
safetensors file in its header's metadata under ``CRC_KEY`` (string values, as the format requires, so
every safetensors reader still reads it), a ``torch.save`` file as the ``CRC_ATTR`` attribute of its
``OrderedDict`` (kept by ``torch.load``, unseen by ``load_state_dict``). Both hold ``crc_table``'s JSON.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Protocol

import torch

from ..errors import CheckpointCorruptError
from .atomic import os_errors

CHUNK = 16 << 20  # bytes read at a time: memory stays flat whatever the file's size


def file_crc32(path: Path) -> int:
    """The CRC-32 of every byte of ``path``."""
    crc = 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with os_errors(path, "read"), open(path, "rb", buffering=0) as f:
        while got := f.readinto(buffer):
            crc = zlib.crc32(view[:got], crc)
    return crc


def check_crc32(path: Path, expected: int | None) -> None:
    """Raise ``CheckpointCorruptError`` unless ``path``'s CRC-32 is ``expected`` (None: a checkpoint saved
    before checksums existed, taken as it is)."""
    if expected is None:
        return
    found = file_crc32(path)
    if found != expected:
        raise CheckpointCorruptError(
            f"{path} is corrupted: its CRC-32 is {found:08x}, the save wrote {expected:08x} (its size is "
            "right, so bytes changed in place: the disk, a copy or an edit). Copy the file again from where it "
            "was saved, or resume from an earlier checkpoint")


CRC_KEY = "bmt_wrap.crc32"  # safetensors metadata: crc_table of every tensor
CRC_ATTR = "bmt_wrap_crc32"  # attribute of a torch.save'd OrderedDict: the same


def crc_table(sums: dict[str, int]) -> str:
    """Per-tensor CRC-32s as JSON text: ``{name: 8 hex digits}`` (the same length whatever the values)."""
    return json.dumps({name: f"{crc:08x}" for name, crc in sums.items()}, separators=(",", ":"))


def parse_crc_table(text: str | None) -> dict[str, int]:
    """``crc_table``'s text read back (None: a file saved without checksums, so none); ``ValueError`` if
    it is not such a table."""
    if text is None:
        return {}
    table = json.loads(text)
    if not isinstance(table, dict) or not all(isinstance(v, str) and len(v) == 8 for v in table.values()):
        raise ValueError(f"{CRC_KEY} is not a table of CRC-32s")
    return {name: int(crc, 16) for name, crc in table.items()}


class TensorSource(Protocol):
    """What a checksum reads a tensor through: formats.Source meets it (formats.py imports this module, so
    the type is declared here instead of imported)."""

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The tensor's shape and dtype."""

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor."""

    def file_of(self, name: str) -> Path:
        """The file holding the tensor."""


def tensor_crc32(source: TensorSource, name: str) -> int:
    """The CRC-32 of tensor ``name``'s bytes in ``source``, read ``CHUNK`` bytes at a time."""
    shape, dtype = source.info(name)
    numel = math.prod(shape)
    step = max(CHUNK // dtype.itemsize, 1)
    buffer = torch.empty(min(step, numel) * dtype.itemsize, dtype=torch.uint8)
    crc = 0
    for start in range(0, numel, step):
        end = min(start + step, numel)
        part = source.read(name, start, end, out=buffer[:(end - start) * dtype.itemsize].view(dtype))
        crc = zlib.crc32(memoryview(part.view(torch.uint8).numpy()), crc)
    return crc


def check_tensor_crc32(source: TensorSource, name: str, expected: int) -> None:
    """Raise ``CheckpointCorruptError`` unless tensor ``name``'s bytes in ``source`` have CRC-32 ``expected``."""
    with os_errors(source.file_of(name), "read"):
        found = tensor_crc32(source, name)
    if found != expected:
        raise CheckpointCorruptError(
            f"{source.file_of(name)} is corrupted: tensor {name!r} has CRC-32 {found:08x}, the save wrote "
            f"{expected:08x}, so its bytes changed since (the disk, a copy or an edit). Copy the file again from "
            "where it was saved, or save it again")
