"""Atomic file writes: a temp file in the destination's directory, fsync, rename; OS errors named."""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError

_FIXES = {
    errno.ENOSPC: "the disk is full: free space or choose another destination",
    errno.EFBIG: "the file size limit was hit (disk quota or `ulimit -f`): raise it or choose another destination",
    errno.EDQUOT: "the disk quota is exhausted: free space or choose another destination",
    errno.ENOTDIR: "a component of the path is a regular file, not a directory: choose another path",
    errno.ENOENT: "the directory does not exist: create it or choose another path",
    errno.EACCES: "permission denied: choose a writable destination",
    errno.EPERM: "operation not permitted: choose a writable destination",
    errno.EROFS: "the file system is read-only: choose a writable destination",
    errno.EISDIR: "the path is a directory: give a file name",
}


def os_error_message(path: Path | str, action: str, exc: OSError) -> str:
    """A one-line message naming ``path``, what failed, the OS's reason and the fix."""
    fix = _FIXES.get(exc.errno or 0, "check the path and the file system")
    return f"cannot {action} {path}: [Errno {exc.errno}] {exc.strerror or exc} — {fix}"


def require_directory(directory: Path) -> None:
    """Raise ``CheckpointError`` unless ``directory`` exists: a mistyped path reads as one, not as a broken save."""
    if not directory.is_dir():
        raise CheckpointError(f"directory not found: {directory}: check the path"
                              + (" (a file is there)" if directory.exists() else ""))


@contextmanager
def os_errors(path: Path | str, action: str) -> Iterator[None]:
    """Turn an ``OSError`` raised inside into a ``CheckpointError`` naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(os_error_message(path, action, exc)) from exc


def make_dirs(path: Path) -> None:
    """``mkdir -p path``, failures as ``CheckpointError``."""
    with os_errors(path, "create directory"):
        path.mkdir(parents=True, exist_ok=True)


class AtomicFile:
    """``path`` appears complete or not at all: written to a temp file beside it, then renamed over it.

    A crash (or an error) before ``commit`` leaves whatever ``path`` held before untouched. With
    ``checksum``, ``crc32`` is the CRC-32 of every byte written so far (computed as they pass: no re-read).
    """

    def __init__(self, path: Path | str, checksum: bool = False) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.crc32: int | None = 0 if checksum else None
        with os_errors(self.path, "write"):
            self.file: BinaryIO | None = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit/abort

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``."""
        assert self.file is not None, "write after commit/abort"
        with os_errors(self.path, "write"):
            self.file.write(data)
        if self.crc32 is not None:
            self.crc32 = zlib.crc32(data, self.crc32)

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written at ``offset`` (a header filled in once its values are known)."""
        assert self.file is not None and self.crc32 is None, "patch after commit, or under a running checksum"
        with os_errors(self.path, "write"):
            self.file.flush()
            os.pwrite(self.file.fileno(), data, offset)

    def commit(self) -> int:
        """Flush, fsync, rename over ``path`` and fsync the directory; returns the file's size."""
        assert self.file is not None, "commit twice"
        with os_errors(self.path, "write"):
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
                size = self.file.tell()
            finally:
                self.file.close()
                self.file = None
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        return size

    def abort(self) -> None:
        """Drop the temp file; ``path`` keeps its previous content."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass  # the write that failed already reported why; closing a broken file adds nothing
            self.file = None
        self.tmp.unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically; returns its size."""
    out = AtomicFile(path)
    try:
        out.write(data)
        return out.commit()
    except BaseException:
        out.abort()
        raise
