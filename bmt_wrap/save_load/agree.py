"""Every rank reaches the same checkpoint verdict (``distributed.agree`` raising ``CheckpointError``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..job import distributed
from ..wrapping.consistency import differences


def agree(error: BaseException | str | None, payload: list[int] | None = None,
          what: str = "checkpoint") -> list[list[int]]:
    """Raise ``CheckpointError`` (or ``error``'s own bmt_wrap type) on every rank if any rank passes an
    ``error``; else every rank's ``payload``."""
    return distributed.agree(error, payload, what, CheckpointError)


def agree_on_directory(directory: Path, call: str) -> None:
    """Raise ``CheckpointError`` on every rank unless all ranks passed ``call`` the same ``directory``: each
    writes its part there, and rank 0 the metadata that lists every part."""
    found = differences({"directory": {"directory": repr(str(directory))}}, "checkpoint directory")
    if found:
        raise CheckpointError(f"{call} writes every rank's part of one checkpoint into one directory, but the ranks "
                              f"passed different ones: {found['directory']}. Pass the same directory on every rank "
                              "(on a file system all ranks share).")
