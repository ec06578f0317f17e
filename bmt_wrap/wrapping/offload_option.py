"""``BMTrainModelWrapper(offload=..., offload_dir=...)``: which offloads this job can run, checked before
anything is sharded, alike on every rank (the device and the arguments are the same everywhere)."""

from __future__ import annotations

import os

import torch

from ..errors import OffloadError, UnsupportedError

OFFLOADS = (None, "disk", "host")


def check_offload(offload: str | None, offload_dir: str | os.PathLike[str] | None, device: torch.device) -> None:
    """Raise unless ``offload``/``offload_dir`` describe an offload this job's ``device`` runs."""
    if offload not in OFFLOADS:
        raise OffloadError(f"offload={offload!r}: give None, 'disk' (a file per rank under offload_dir=) or "
                           "'host' (pinned host memory, for CUDA jobs)")
    if offload is None:
        if offload_dir is not None:
            raise OffloadError(f"offload_dir={os.fspath(offload_dir)!r} without offload='disk': pass "
                               "offload='disk' to keep the shards there, or drop offload_dir=")
        return
    if offload == "host":
        if device.type == "cpu":
            raise OffloadError(
                "offload='host' moves shards from the device to host memory, and this CPU job's shards are "
                "in host memory already: to take them out of the process's memory, use offload='disk', "
                "offload_dir=<a directory on a disk>")
        raise UnsupportedError("offload='host' (pinned host memory for a CUDA job) is not built yet "
                               "(issue 37): use AdamOffloadOptimizer for the optimizer state, or shard over "
                               "more ranks")
    if device.type != "cpu":
        raise UnsupportedError("offload='disk' is built for CPU jobs only so far (issue 37); a CUDA job "
                               "would stage the shards through pinned host memory")
    if offload_dir is None:
        raise OffloadError("offload='disk' needs offload_dir=: a directory on a disk (not tmpfs, whose "
                           "pages are memory again) where each rank keeps a file of its shards")
