"""``bmt.save`` / ``bmt.load``: the whole model in one file under its original names.

Save streams: rank 0 writes the safetensors header (every offset follows from the layout), then one flat
buffer at a time is gathered and written, so rank 0 holds at most one buffer beyond its shard. ``.pt`` /
``.bin`` go through ``torch.save``, which needs the whole state dict on rank 0. Load never gathers: each
rank reads its own slices from the file (memory-mapped).

Both formats carry each tensor's CRC-32 (checksum.py); a load first checks the tensors it will read, each
by one rank (split by bytes), so a file whose bytes changed since the save raises
``CheckpointCorruptError`` on every rank, naming the file and the tensor, before anything is read.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..errors import CheckpointError, listed
from ..job.distributed import get_state, in_first_replica, writes_for_all
from ..job.tp_values import whole_value
from ..runtime.comm import collective_purpose
from ..wrapping.init import rebuild_lost_buffers
from .agree import agree
from .checksum import check_tensor_crc32
from .directory import FilesSource, open_checkpoint
from .entries import Entry, by_buffer, materialize, meta_names, model_entries
from .formats import SafetensorsWriter, Source, TorchWriter, file_format


class LoadResult(NamedTuple):
    """Keys of the model absent from the file, and keys of the file the model does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Write every ``state_dict`` key of ``model`` (full tensors, original names) to ``path``; a collective.

    ``.safetensors`` (metadata ``{"format": "pt"}`` and each tensor's CRC-32, loadable by ``transformers``) is
    streamed one flat buffer at a time; ``.pt``/``.bin``/``.pth`` use ``torch.save`` (an ``OrderedDict``
    carrying the CRC-32s), so rank 0 holds the whole state. The file is replaced atomically: if saving
    fails, every rank raises ``CheckpointError`` and ``path`` is unchanged.
    """
    path = Path(path)
    with collective_purpose("save", str(path)):
        kind = file_format(path)
        entries = model_entries(model)
        if meta := meta_names(entries):
            raise CheckpointError(f"cannot save to {path}: {listed(meta)} are still on the meta device; initialise them "
                                  "(bmt.init_parameters(model)) or load them (bmt.load(model, path)) first")
        groups, replicated = by_buffer(entries)
        ordered = [e for _, members in groups for e in members] + replicated
        out = _RankZeroWriter(path, kind, ordered, entries) if writes_for_all() else None
        # Under HSDP every replica holds the same shards: the writer's replica gathers, the others wait.
        for buffer, members in groups if in_first_replica() else []:
            full = buffer.group.gather_values(only=buffer)[0]
            for e in members:
                slot = buffer.spec.slots[e.param.slot_index]  # type: ignore[union-attr]
                value = full[slot.offset:slot.offset + slot.numel].view(e.param.full_shape)  # type: ignore[union-attr]
                value = whole_value(e.param, value)  # TP-split: every TP rank's slice (a collective)
                for names, tensor in e.file_values(value):  # a list expert's: every EP rank's (a collective)
                    if out is not None:
                        out.put(names, tensor)
            del full
        for e in replicated:
            if out is not None:
                out.put(e.names, e.local().view(e.shape))  # local() is flat; the file holds the full shape
        agree(out.finish() if out is not None else None, what="save")


class _RankZeroWriter:
    """Rank 0's file: a failure is remembered, not raised, so rank 0 keeps joining the gathers the other
    ranks are in; the error is raised everywhere at the end."""

    def __init__(self, path: Path, kind: str, ordered: list[Entry], entries: list[Entry]) -> None:
        self.error: str | None = None
        self.writer: SafetensorsWriter | TorchWriter | None = None
        try:
            if kind == "safetensors":
                specs = [s for e in ordered for s in e.specs()]
                self.writer = SafetensorsWriter(path, specs, {"format": "pt"}, tensor_checksums=True)
            else:
                self.writer = TorchWriter(path, [n for e in entries for n in e.file_names])
        except CheckpointError as exc:
            self.error = str(exc)

    def put(self, names: list[str], tensor: torch.Tensor) -> None:
        """Write one tensor, unless an earlier write failed."""
        if self.writer is None:
            return
        try:
            self.writer.put(names, tensor)
        except CheckpointError as exc:
            self.fail(exc)

    def fail(self, exc: CheckpointError) -> None:
        """Remember the first failure and drop the partial file."""
        self.error = str(exc)
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def finish(self) -> str | None:
        """Commit the file; the first error, if any."""
        if self.writer is not None:
            try:
                self.writer.commit()
            except CheckpointError as exc:
                self.fail(exc)
        return self.error


def load(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> LoadResult:
    """Load a file written by ``bmt.save`` or ``torch.save(state_dict)`` (tied aliases optional), or a
    ``save_pretrained`` directory (one file or index-named shards); a collective.

    Each rank reads only its slices' bytes, so a rank's memory grows by its shard, not by the model.
    Floating tensors are cast to the model's dtype, as ``load_state_dict`` does.
    The header, sizes, keys and the CRC-32s the save recorded (each tensor checked by one rank) are
    checked and the verdict agreed before any data is read, so a bad file raises ``CheckpointError``
    (``CheckpointCorruptError`` naming the tensor whose bytes changed) on every rank. Files without
    CRC-32s (saved before they existed, or by another writer) load on their headers alone. Meta-device
    models are materialised here: no ``init_parameters`` needed.
    """
    path = Path(path)
    with collective_purpose("load", str(path)):
        entries = model_entries(model)
        plan: list[tuple[Entry, str]] = []
        result = LoadResult([], [])
        error = None
        try:
            source = open_checkpoint(path)
            plan, result = match_keys(entries, source, strict)
            check_my_share(source, [n for e, key in plan for n in e.ep_names or [key]])  # the same keys on every rank
        except CheckpointError as exc:
            # A subclass (CheckpointCorruptError) keeps its type on every rank; a plain one is agree's own.
            error = exc if type(exc) is not CheckpointError else str(exc)
        agree(error, what="load")
        materialize(entries, get_state().device)
        error = None
        try:
            for entry, key in plan:
                into = entry.destination(source.info(key)[1])
                if into is not None:
                    source.read(key, *entry.local_range(), out=into)  # no temporary: grows by the shard
                else:
                    entry.assign(source.read(key, *entry.local_range()))
        except Exception as exc:  # noqa: BLE001 - a read failing on one rank must not leave the others waiting
            error = f"cannot read {path}: {type(exc).__name__}: {exc}"
        agree(error, what="load")
        rebuild_lost_buffers(model)
        return result


def check_my_share(source: Source | FilesSource, keys: list[str]) -> None:
    """Check this rank's share of ``keys`` against the CRC-32s the save recorded. Tensors are dealt out
    largest first to the rank with the fewest bytes so far (every rank computes the same split), so each
    rank reads about 1/N of the file."""
    state = get_state()
    sizes = {k: math.prod(shape) * dtype.itemsize for k in dict.fromkeys(keys) if k in source.checksums
             for shape, dtype in [source.info(k)]}
    loads = [0] * state.world_size
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = loads.index(min(loads))
        loads[rank] += sizes[key]
        if rank == state.rank:
            check_tensor_crc32(source, key, source.checksums[key])


def match_keys(entries: list[Entry], source: Source | FilesSource,
               strict: bool) -> tuple[list[tuple[Entry, str]], LoadResult]:
    """Which file key loads each entry (any of its names); raises naming every mismatch."""
    keys = source.keys()
    present = set(keys)
    plan: list[tuple[Entry, str]] = []
    missing: list[str] = []
    mismatched: list[str] = []
    for e in entries:
        key = next((n for n in e.names if n in present), None)
        if key is None:
            missing.extend(e.names)
            continue
        shape, dtype = source.info(key)
        # Floating values are cast to the model's dtype, as load_state_dict does (a bf16 checkpoint into
        # fp32 masters); anything else must match.
        castable = dtype.is_floating_point and e.dtype.is_floating_point
        if shape != e.shape or (dtype != e.dtype and not castable):
            mismatched.append(f"{key!r} is {dtype} {list(shape)} in {source.file_of(key).name} but {e.name!r} "
                              f"is {e.dtype} {list(e.shape)} in the model")
        plan.append((e, key))
    known = {n for e in entries for n in e.file_names + e.names}  # other EP ranks' list experts are theirs
    unexpected = [k for k in keys if k not in known]
    problems = [listed(mismatched, 3, str, "; ")] if mismatched else []
    if strict and (missing or unexpected):
        keys_off = [f"{what} keys {listed(names)}" for what, names in (("missing", missing), ("unexpected", unexpected))
                    if names]
        problems.append(", ".join(keys_off) + " (pass strict=False to skip them)")
    if problems:
        raise CheckpointError(f"{source.path} does not match the model's {len(entries)} tensors: " + "; ".join(problems)
                              + ". Is it a checkpoint of this model?")
    return plan, LoadResult(missing, unexpected)
