"""``StateFile``: optimizer state in a per-process file, read and written through one bounded buffer.

The file is reached with positioned reads and writes (``os.preadv``/``os.pwritev``) into a buffer of fixed
size, never memory-mapped: pages of a mapped file count in the process's resident memory (VmRSS) once
touched, which is exactly what a memory limit on a training job measures, while pages the kernel caches for
``pread`` belong to no process and are reclaimed under pressure. Space is reserved with
``posix_fallocate`` when a range is handed out, so a full disk is an error then, naming the file, rather
than a short write in the middle of an update (runtime/backing_file.py).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from ..errors import OptimizerError
from ..runtime.backing_file import BackingFile


@dataclass
class IOStats:
    """Bytes moved between the state file and memory."""

    read: int = 0
    written: int = 0


class StateFile(BackingFile):
    """A ``BackingFile`` (in a fresh directory under ``directory``) and a ``buffer_bytes`` staging buffer.

    ``allocate`` hands out byte ranges; ``read``/``write`` move whole ranges between the file and tensors
    in host memory.
    """

    def __init__(self, directory: str | os.PathLike[str], buffer_bytes: int,
                 prefix: str = "bmt_state_") -> None:
        super().__init__(directory, prefix, "optimizer state", OptimizerError,
                         closed_hint="build a new optimizer, or load its state_dict() into one")
        self.stats = IOStats()
        self.buffer = torch.empty(buffer_bytes // 8 * 8, dtype=torch.uint8)  # whole fp64/fp32 elements

    def read(self, dst: torch.Tensor, offset: int) -> None:
        """Fill contiguous host tensor ``dst`` from the file at ``offset``."""
        self._check_open()
        view = _bytes_of(dst)
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise OptimizerError(f"reading optimizer state from {self.path!r} failed: "
                                     f"{exc.strerror}") from None
            if got == 0:
                raise OptimizerError(f"optimizer state file {self.path!r} ends at byte {offset + done:,}, "
                                     f"{len(view) - done:,} bytes short: it was truncated or replaced")
            done += got
        self.stats.read += done

    def write(self, src: torch.Tensor, offset: int) -> None:
        """Write contiguous host tensor ``src`` into the file at ``offset``."""
        self._check_open()
        view = _bytes_of(src)
        done = 0
        while done < len(view):
            try:
                done += os.pwritev(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise OptimizerError(f"writing optimizer state to {self.path!r} failed after {done:,} of "
                                     f"{len(view):,} bytes: {exc.strerror}: free space there or choose "
                                     "another offload_dir=") from None
        self.stats.written += done


def _bytes_of(t: torch.Tensor) -> memoryview:
    """``t``'s memory as a writable byte view (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise OptimizerError("the state file moves contiguous host tensors only")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")
