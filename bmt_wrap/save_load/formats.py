"""File formats: a streaming safetensors writer, a ``torch.save`` writer, and readers of flattened ranges.

Readers expose one operation, ``read(name, start, end)``: elements ``[start, end)`` of the flattened
tensor, reading only their bytes (safetensors: one positioned read; ``torch.load(mmap=True)``).
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from .atomic import AtomicFile
from .checksum import CRC_ATTR, CRC_KEY, crc_table, parse_crc_table

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
TORCH_SUFFIXES = (".pt", ".bin", ".pth", ".ckp")  # BMTrain's tests name torch.save files .ckp


def file_format(path: Path) -> str:
    """``"safetensors"`` or ``"torch"``, from the file name's suffix."""
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in TORCH_SUFFIXES:
        return "torch"
    raise CheckpointError(f"{path}: unknown checkpoint format {path.suffix!r}; name the file *.safetensors "
                          f"(streamed, recommended) or one of {', '.join('*' + s for s in TORCH_SUFFIXES)}")


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor in a file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


def torch_bytes(obj: Any) -> bytes:
    """``obj`` serialised by ``torch.save``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (copied to the CPU only when it is elsewhere)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())


class SafetensorsWriter:
    """Streams a safetensors file: the header first (every offset is known from the specs), then the
    tensors in spec order, so no more than the tensor being written needs to be in memory.

    ``checksum``: the CRC-32 of the whole file (``out.crc32``, for a caller to record elsewhere).
    ``tensor_checksums``: each tensor's CRC-32 in the file's own metadata (``CRC_KEY``), computed as it is
    written; the header holds a placeholder of the same length until ``commit`` fills it in."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str], checksum: bool = False,
                 tensor_checksums: bool = False) -> None:
        self._sums: dict[str, int] | None = {s.name: 0 for s in specs} if tensor_checksums else None
        if self._sums is not None:
            metadata = {**metadata, CRC_KEY: crc_table(self._sums)}
        header: dict[str, Any] = {"__metadata__": metadata}
        pos = 0
        for s in specs:
            if s.dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path}: tensor {s.name!r} has dtype {s.dtype}, which safetensors cannot "
                                      "store; save to a .pt file instead")
            header[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [pos, pos + s.nbytes]}
            pos += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        # The metadata comes first in the header, so the table's first occurrence is its own.
        self._sums_at = None if self._sums is None else 8 + raw.index(self._encoded_sums())
        self.specs = specs
        self._next = 0
        self.out = AtomicFile(path, checksum)
        self.out.write(struct.pack("<Q", len(raw)) + raw)

    def put(self, names: list[str], tensor: torch.Tensor) -> None:
        """Write ``tensor`` under each of ``names`` (the next specs, in order)."""
        data = tensor_bytes(tensor)
        crc = zlib.crc32(data) if self._sums is not None else 0
        for name in names:
            spec = self.specs[self._next]
            assert spec.name == name and len(data) == spec.nbytes, (spec, name, len(data))
            self.out.write(data)
            if self._sums is not None:
                self._sums[name] = crc
            self._next += 1

    def _encoded_sums(self) -> bytes:
        """The CRC table as the header's JSON writes it (a string value: quotes escaped)."""
        assert self._sums is not None
        return json.dumps(crc_table(self._sums))[1:-1].encode()

    def commit(self) -> int:
        """Finish the file (atomically); returns its size."""
        assert self._next == len(self.specs), "not every tensor was written"
        if self._sums_at is not None:
            self.out.patch(self._sums_at, self._encoded_sums())
        return self.out.commit()

    def abort(self) -> None:
        """Drop the partial file."""
        self.out.abort()


class TorchWriter:
    """Collects full tensors and writes them with ``torch.save`` at the end: the whole state is in memory
    on the writing rank (use .safetensors to stream instead). Each tensor's CRC-32 goes with them, as the
    ``CRC_ATTR`` attribute of the ``OrderedDict`` saved (what ``state_dict()`` returns too)."""

    def __init__(self, path: Path, order: list[str]) -> None:
        self.order = order
        self.tensors: dict[str, torch.Tensor] = {}
        self.sums: dict[str, int] = {}
        self.out = AtomicFile(path)  # opened now: an unwritable destination fails before anything is gathered

    def put(self, names: list[str], tensor: torch.Tensor) -> None:
        """Keep a CPU copy of ``tensor`` under each of ``names`` (one copy: aliases share it, as in torch)."""
        copy = tensor.detach().to("cpu", copy=True)
        crc = zlib.crc32(tensor_bytes(copy))
        for name in names:
            self.tensors[name] = copy
            self.sums[name] = crc

    def commit(self) -> int:
        """Write the file (atomically); returns its size."""
        state = OrderedDict((n, self.tensors[n]) for n in self.order)
        setattr(state, CRC_ATTR, crc_table({n: self.sums[n] for n in self.order}))
        # Serialised in memory first: torch's zip writer hides the OS error (errno) of a failed write.
        self.out.write(torch_bytes(state))
        return self.out.commit()

    def abort(self) -> None:
        """Drop the partial file."""
        self.out.abort()


# ---- readers ---------------------------------------------------------------------------------------------
class Source(Protocol):
    """A checkpoint file opened for reading parts of tensors."""

    path: Path
    checksums: dict[str, int]  # CRC-32 of each tensor's bytes, as the save recorded them (none: not recorded)

    def keys(self) -> list[str]:
        """Every tensor name in the file."""

    def file_of(self, name: str) -> Path:
        """The file that holds ``name``."""

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name``."""

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name`` (1-D), into ``out`` when given (a
        contiguous 1-D tensor of the file's dtype)."""


class SafetensorsSource:
    """A safetensors file read with positioned reads: a range of a tensor is one ``readinto`` of its bytes,
    so a rank's memory grows by what it reads and nothing else (a memory map's touched pages would count
    in its RSS until the file is closed, doubling a rank's shard during a load)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        self._data_start = 8 + length
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.checksums = parse_crc_table(self.metadata.get(CRC_KEY))
        self._tensors: dict[str, tuple[tuple[int, ...], str, int, int]] = {}
        for name, t in header.items():
            begin, end = t["data_offsets"]
            if not 0 <= begin <= end <= size - self._data_start:
                raise ValueError(f"tensor {name!r} lies at bytes {begin}..{end}, beyond the file's end")
            self._tensors[name] = (tuple(t["shape"]), t["dtype"], begin, end)

    def keys(self) -> list[str]:
        """Every tensor name in the file."""
        return list(self._tensors)

    def file_of(self, name: str) -> Path:
        """The file that holds ``name``: this one."""
        return self.path

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name``."""
        shape, dtype, _, _ = self._tensors[name]
        if dtype not in _TORCH_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {dtype}, which bmt_wrap does not load")
        return shape, _TORCH_DTYPES[dtype]

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``: exactly their bytes are read, straight
        into ``out`` when given (no temporary)."""
        _, dtype = self.info(name)
        out = torch.empty(max(end - start, 0), dtype=dtype) if out is None else out
        assert out.dtype == dtype and out.is_contiguous() and out.numel() == max(end - start, 0), name
        if out.numel():
            begin = self._data_start + self._tensors[name][2] + start * dtype.itemsize
            view = memoryview(out.view(torch.uint8).numpy())
            with open(self.path, "rb", buffering=0) as f:
                f.seek(begin)
                done = 0
                while done < len(view):  # one read(2) moves at most ~2 GiB
                    got = f.readinto(view[done:])
                    if not got:
                        raise CheckpointError(f"{self.path}: tensor {name!r} is cut short: the file is "
                                              "truncated")
                    done += got
        return out


class TorchSource:
    """A ``torch.save``'d state dict, memory-mapped (zip format), so reads touch only the pages they need."""

    def __init__(self, path: Path) -> None:
        self.path = path
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of tensors: pass a "
                                  "file written by bmt.save or torch.save(model.state_dict())")
        self._state: dict[str, torch.Tensor] = state
        self.checksums = parse_crc_table(getattr(state, CRC_ATTR, None))

    def keys(self) -> list[str]:
        """Every tensor name in the file."""
        return list(self._state)

    def file_of(self, name: str) -> Path:
        """The file that holds ``name``: this one."""
        return self.path

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of ``name``."""
        t = self._state[name]
        return tuple(t.shape), t.dtype

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``, copied into ``out`` when given."""
        part = self._state[name].reshape(-1)[start:end]
        return part if out is None else out.copy_(part)


def open_source(path: Path) -> Source:
    """Open a checkpoint file for reading; any failure is a ``CheckpointError`` naming the file."""
    kind = file_format(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist or is not a file: check the path")
    try:
        return SafetensorsSource(path) if kind == "safetensors" else TorchSource(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure means the same thing: not a usable file
        raise CheckpointError(f"{path} is not a readable {kind} file ({type(exc).__name__}: {exc}); it may be "
                              "truncated, corrupted or of another format: save it again") from exc
