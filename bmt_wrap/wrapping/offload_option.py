"""``BMTrainModelWrapper(offload=..., offload_dir=...)``: which offloads this job can run, checked before
anything is sharded, alike on every rank (the device and the arguments are the same everywhere), and the
store each rank keeps its shards in."""

from __future__ import annotations

import os

import torch

from ..errors import OffloadError, UnsupportedError
from ..runtime.comm import Communicator
from ..runtime.host_store import HostStore
from ..runtime.offload import ShardFile, agree_offload
from ..runtime.shard_store import ShardStore

OFFLOADS = (None, "disk", "host")

#: Test seam: with this environment variable set to 1, ``offload="host"`` runs on a CPU job too, through the
#: same host store and streaming code as on CUDA (plain copies instead of pinned memory and a side stream).
#: It saves no memory there (a CPU job's shards are host memory already); tests use it to check the
#: streaming without a GPU (tests/test_offload_host.py).
HOST_ON_CPU = "BMT_WRAP_HOST_OFFLOAD_ON_CPU"


def check_offload(offload: str | None, offload_dir: str | os.PathLike[str] | None, device: torch.device) -> None:
    """Raise unless ``offload``/``offload_dir`` describe an offload this job's ``device`` runs."""
    if offload not in OFFLOADS:
        raise OffloadError(f"offload={offload!r}: give None, 'disk' (a file per rank under offload_dir=) or "
                           "'host' (pinned host memory, for CUDA jobs)")
    if offload is None or offload == "host":
        if offload_dir is not None:
            raise OffloadError(f"offload_dir={os.fspath(offload_dir)!r} without offload='disk': pass "
                               "offload='disk' to keep the shards there, or drop offload_dir=")
        if offload == "host" and device.type == "cpu" and os.environ.get(HOST_ON_CPU) != "1":
            raise OffloadError(
                "offload='host' moves shards from the device to host memory, and this CPU job's shards are "
                "in host memory already: to take them out of the process's memory, use offload='disk', "
                "offload_dir=<a directory on a disk>")
        return
    if device.type != "cpu":
        raise UnsupportedError("offload='disk' is built for CPU jobs only so far (issue 37); on a CUDA job use "
                               "offload='host' (pinned host memory)")
    if offload_dir is None:
        raise OffloadError("offload='disk' needs offload_dir=: a directory on a disk (not tmpfs, whose "
                           "pages are memory again) where each rank keeps a file of its shards")


def offload_store(comm: Communicator, offload: str | None, offload_dir: str | os.PathLike[str] | None,
                  device: torch.device) -> ShardStore | None:
    """This rank's store for ``offload`` (None without offload); a rank that cannot make one fails every rank."""
    if offload is None:
        return None
    store, problem = None, None
    try:
        store = HostStore(device) if offload == "host" else ShardFile(offload_dir, comm.rank)  # type: ignore[arg-type]
    except OffloadError as exc:
        problem = exc
    agree_offload(comm, problem, "creating offload files" if offload == "disk" else "creating the host store")
    assert store is not None
    return store
