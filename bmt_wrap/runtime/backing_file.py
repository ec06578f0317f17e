"""``BackingFile``: a file of this process's own, in a fresh directory, whose byte ranges are reserved on disk
when handed out.

Both kinds of offload stand on it: ``AdamDiskOptimizer``'s state file (optim/state_file.py, positioned reads
and writes through a staging buffer) and the offloaded shards (offload.py, mapped ranges). Space is reserved
with ``posix_fallocate`` when a range is handed out, so a full disk (or a file-size limit) is an error then,
naming the file, rather than a short write, or a ``SIGBUS`` through a mapping, in the middle of a step. The
directory is removed by ``close()``, when the object is collected, or at exit.

A process killed before it could remove its directory (``SIGKILL``, the out-of-memory killer) leaves it
behind, often many GB. Each directory's name carries its process id and host
(``<prefix>pid<pid>@<host>.<random>``), so the next ``BackingFile`` made in the same place removes those
whose process is gone: only on the same host, and only when no process of that id runs (a live one, even
one that merely reuses the id, keeps its directory), with a warning naming each path and its size.

A directory on a filesystem held in memory (tmpfs: ``/dev/shm``, often ``/tmp`` in containers) is taken with
an ``OffloadWarning`` naming the filesystem: its pages are memory, so the file saves nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import warnings
import weakref

from ..base.log import says_for_node
from ..base.plan import fmt_bytes
from ..errors import BMTError, OffloadWarning

#: Filesystems whose files are memory pages (the kernel's tmpfs and ramfs, and /dev's devtmpfs).
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")

# What BackingFile names its directories (``mkdtemp``'s random tail has no dot).
_OURS = re.compile(r"^bmt_\w+?_pid(?P<pid>\d+)@(?P<host>.+)\.[a-z0-9_]+$")


def _remove(fd: int, directory: str) -> None:
    os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _unescape(field: str) -> str:
    """A path field of /proc/self/mounts (space, tab, newline and backslash are written as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def filesystem_of(directory: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The type and mount point of the filesystem holding ``directory`` (Linux's /proc/self/mounts), or
    None where that cannot be read."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    path = os.path.realpath(directory)
    found: tuple[str, str] | None = None
    for fields in mounts:
        if len(fields) < 3:
            continue
        mount = _unescape(fields[1])
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        # The deepest mount point holding the path; of equal ones the last, which is mounted over the others.
        if inside and (found is None or len(mount) >= len(found[1])):
            found = (fields[2], mount)
    return found


def warn_if_in_memory(directory: str | os.PathLike[str], what: str) -> None:
    """Warn (``OffloadWarning``) when ``directory`` is on a filesystem held in memory, naming it."""
    fs = filesystem_of(directory)
    if fs is not None and fs[0] in MEMORY_FILESYSTEMS and says_for_node():
        warnings.warn(f"offload_dir={os.fspath(directory)!r} is on {fs[0]} (mounted at {fs[1]}), a filesystem "
                      f"held in memory: the {what} written there stay in memory, so offloading them saves "
                      "nothing. Give offload_dir= a directory on a disk (docs/offload.md; said by local rank 0 for the "
                      "node's ranks)",
                      OffloadWarning, stacklevel=4)


def sweep_stale(directory: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """Remove the directories that dead processes of this host left under ``directory``; each one removed,
    with the bytes it held on disk (also said in a warning)."""
    host = socket.gethostname()
    removed: list[tuple[str, int]] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed  # the caller's own creation says why
    for name in names:
        match = _OURS.match(name)
        path = os.path.join(os.fspath(directory), name)
        if match is None or match["host"] != host or int(match["pid"]) == os.getpid() or not os.path.isdir(path):
            continue
        if _pid_alive(int(match["pid"])):
            continue
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append((path, size))
    if removed:
        warnings.warn("removed offload files that killed processes left behind: " + ", ".join(
            f"{path} ({fmt_bytes(size)})" for path, size in removed), stacklevel=3)
    return removed


class BackingFile:
    """A file (``path``) in a fresh directory under ``directory``; ``allocate`` reserves ranges at its end."""

    def __init__(self, directory: str | os.PathLike[str], prefix: str, what: str,
                 error_type: type[BMTError], name: str = "state.bin", closed_hint: str = "") -> None:
        self.what = what  # how errors name the file's contents ("optimizer state", "offloaded shards")
        self.error_type = error_type
        self.closed_hint = closed_hint  # what to do after ``close()``, for the error an access then raises
        sweep_stale(directory)
        try:
            tagged = f"{prefix}pid{os.getpid()}@{socket.gethostname()}."
            self.directory = tempfile.mkdtemp(prefix=tagged, dir=os.fspath(directory))
            self.path = os.path.join(self.directory, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise error_type(f"cannot create {what} under {os.fspath(directory)!r}: {exc.strerror}: give "
                             "offload_dir= an existing directory this process can write") from None
        self.fd = fd
        self.size = 0
        self._finalizer = weakref.finalize(self, _remove, fd, self.directory)
        warn_if_in_memory(directory, what)  # last: a warning raised as an error leaves nothing open

    def close(self) -> None:
        """Close and delete the file (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (or the object was collected)."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise self.error_type(f"{self.what} file {self.path!r} was closed (close() deletes it)"
                                  f"{': ' + self.closed_hint if self.closed_hint else ''}")

    def allocate(self, nbytes: int, align: int = 1) -> int:
        """Reserve ``nbytes`` of zeros at the end of the file (from a multiple of ``align``); their offset."""
        self._check_open()
        offset = -(-self.size // align) * align
        if nbytes > 0:
            try:
                os.posix_fallocate(self.fd, offset, nbytes)
            except OSError as exc:
                raise self.error_type(f"cannot reserve {nbytes:,} bytes of {self.what} in {self.path!r}: "
                                      f"{exc.strerror}: free space there or choose another offload_dir=") from None
        self.size = max(self.size, offset + nbytes)
        return offset

    def truncated(self) -> str | None:
        """Why the file no longer holds what was reserved in it (deleted, truncated), or None."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError as exc:
            return f"{self.what} file {self.path!r} cannot be checked: {exc.strerror}"
        if size < self.size:
            return (f"{self.what} file {self.path!r} holds {size:,} bytes, {self.size - size:,} short of what "
                    "was written to it: it was truncated or replaced while the job ran")
        return None
