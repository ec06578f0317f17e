"""Resumable sharded checkpoints: each rank writes its slices; loadable at any (tp, ep, dp) layout.

A directory holds, per rank, ``shard-R-of-N.<id>.safetensors`` (its parameter slices and optimizer state
tensors, by parameter name) and ``state-R-of-N.<id>.pt`` (RNG states, plain optimizer values; rank 0's
also holds param groups, loss scaler, schedulers, step and ``extra``), then ``metadata.json``, written
last and atomically by rank 0: names, whole shapes, dtypes, where each rank's part of every tensor sits
in the whole (the tensor-parallel split dimension, each file's TP rank and the TP size; then each rank's
flat element range of its TP slice: ``reshard.Piece``; an expert tensor under expert parallelism is cut
by EP rank instead, each EP rank holding its experts), world size, file sizes and CRC-32s. A
directory without it is an unfinished save and is refused; a new save replaces the old one only when
its ``metadata.json`` lands, so a failed save leaves the previous checkpoint whole. A load checks every
file's size and CRC-32 (each file by one rank) before reading anything; a checkpoint saved before
checksums were written (its metadata has none) loads on sizes and headers alone.

Loading reshards by name: each rank reads, for each tensor, the overlap of its own piece with every
saved rank's piece (``reshard.py``), so a checkpoint saved at any tensor-, expert- and data-parallel
layout loads at any other, and ``consolidated_state_dict`` reads one into a plain ``state_dict`` in one process. Under
TP, a tensor TP does not split is written by every rank holding a range of it (the one-liner shards it
over shard x TP), or, where it stays whole on each TP peer (the explicit API), by the TP rank 0 of each
data-parallel rank only. The format
is ours rather than ``torch.distributed.checkpoint``'s because a rank's slice is an arbitrary element
range of a flattened parameter (aligned flat buffers), which neither DTensor placements nor DCP's
row-chunk planner express; safetensors files keep each read a slice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.dtypes import dtype_name, to_dtype
from ..errors import CheckpointError, listed
from ..job.distributed import broadcast_bytes, get_state, parallel_layout, shard_placement
from ..runtime.comm import collective_purpose
from ..wrapping.init import rebuild_lost_buffers
from . import optim_state, rng
from .agree import agree, agree_on_directory
from .atomic import make_dirs, os_errors, require_directory, write_atomic
from .checksum import check_crc32
from .entries import Entry, materialize, meta_names, model_entries, with_peers
from .formats import SafetensorsSource, SafetensorsWriter, TensorSpec, torch_bytes
from .reshard import Piece, copy_overlaps, overlaps, shared, span

Plan = list[tuple[int, list[Any]]]  # (saved rank, the boxes shared with it) for one tensor

METADATA = "metadata.json"
FORMAT = "bmt_wrap.sharded"
VERSION = 3  # 2: tensor-parallel pieces (tp_size, per file tp_rank, per tensor tp_dim and tp_parts, absent
# meaning 1); 1 loads as tp_size 1; 3: expert-parallel pieces (ep_size, per file ep_rank, per expert tensor
# ep_dim), 2 loading as ep_size 1
READABLE = (1, 2, VERSION)


@dataclass
class CheckpointInfo:
    """What ``load_checkpoint`` restored besides tensors."""

    step: int | None
    extra: Any
    saved_world_size: int
    rng_restored: bool  # False: resumed at another world size or tp_size, RNGs reseeded (see ``rng.reseed``)


def _file_names(rank: int, world: int, save_id: str) -> tuple[str, str]:
    return f"shard-{rank:05d}-of-{world:05d}.{save_id}.safetensors", f"state-{rank:05d}-of-{world:05d}.{save_id}.pt"


def _writers(e: Entry, world: int, placement: list[tuple[int, int]] | None,
             tp_ranks: list[int]) -> list[bool]:
    """Which ranks write ``e``: rank 0 a replicated tensor; else the first replica's ranks (under HSDP the
    others hold the same shards), and of a tensor TP does not split, the TP rank 0 of each when its TP
    peers hold the same range (every rank when it is sharded over shard x tp ranks)."""
    if e.absent:
        return [False] * world
    if e.param is None:
        return [r == 0 for r in range(world)]
    return [(placement is None or placement[r][1] == 0) and (e.tp_split or e.over_tp or tp_ranks[r] == 0)
            for r in range(world)]


def _ranges(e: Entry, writers: list[bool], placement: list[tuple[int, int]] | None) -> list[list[int]]:
    """Every rank's ``[start, end)`` of the flattened tensor (TP-split: of its TP slice); empty where
    that rank does not write it."""
    if e.param is None:
        return [[0, e.numel] if w else [0, 0] for w in writers]
    # A buffer over shard x tp ranks: a rank's index in it is its place in its replica (replicas are
    # runs of consecutive ranks); else its shard rank.
    per_replica = len(writers) // (1 + max((p[1] for p in placement), default=0)) if placement else len(writers)
    return [list(e.param.source_range(r % per_replica if e.over_tp else r if placement is None else placement[r][0]))
            if w else [0, 0] for r, w in enumerate(writers)]


def _own_ranges(entries: list[Entry], writers: dict[str, list[bool]], rank: int) -> dict[str, list[list[int]]]:
    """Under pipeline or expert parallelism, every rank's ``[start, end)`` of each tensor (TP- or EP-split: of
    its slice), each rank telling its own (one all-reduce): only a tensor's stage knows where its shards are
    (another stage holds a ghost of it, and a stage sharing a tensor with its owner, a tied embedding, leaves
    it to the owner), and an expert buffer is sharded over the ranks owning the same experts."""
    mine: list[int] = []
    for e in entries:
        stage = e.param.flat_buffer.stage if e.param is not None else None
        held = writers[e.name][rank] and (stage is None or stage.here)
        piece = e.piece()
        mine += [piece.start, piece.end] if held and e.param is not None else [0, e.numel] if held else [0, 0]
    table = agree(None, mine, what="save_checkpoint ranges")
    return {e.name: [row[2 * i:2 * i + 2] for row in table] for i, e in enumerate(entries)}


def _cut(e: Entry) -> dict[str, Any]:
    """How ``e``'s saved pieces are cut before ZeRO's ranges (``CheckpointReader.saved_piece``): an expert
    tensor's experts by EP rank, else the TP cut."""
    piece = e.piece()
    if e.expert:
        return {"ep_dim": piece.tp_dim}
    return {"tp_dim": piece.tp_dim, "tp_parts": piece.tp_parts}


def _param_names(entries: list[Entry]) -> dict[int, str]:
    return {id(e.param if e.param is not None else e.value): e.name for e in entries}


def _peers(entries: list[Entry]) -> dict[str, list[str]]:
    """Each of this rank's list experts' names -> the names of every EP rank's at its place (``with_peers``)."""
    return {e.name: e.ep_names for e in entries if e.ep_names is not None}


def _peer_kinds(kinds: list[dict[str, dict[str, str]]], peers: dict[str, list[str]], world: int) -> None:
    """Add every rank's list experts' optimizer state kinds to ``kinds`` (rank 0's go in the metadata): each
    rank's own in turn, a broadcast from each rank."""
    mine = json.dumps([{n: keys for n, keys in kind.items() if n in peers} for kind in kinds]).encode()
    for r in range(world):
        theirs = json.loads(broadcast_bytes(mine if get_state().rank == r else None, src=r))
        for kind, more in zip(kinds, theirs, strict=True):
            kind.update(more)


def save_checkpoint(directory: str | os.PathLike, model: nn.Module, optim_manager: Any = None,
                    optimizer: torch.optim.Optimizer | None = None, step: int | None = None, extra: Any = None) -> None:
    """Write this rank's shard of ``model`` and optimizer state, plus RNG/scaler/scheduler state; a collective.

    ``extra`` must be loadable with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists,
    dicts). If any rank fails, every rank raises ``CheckpointError`` and the previous checkpoint in
    ``directory`` stays loadable.
    """
    directory = Path(directory)
    with collective_purpose("save_checkpoint", str(directory)):
        agree_on_directory(directory, "bmt.save_checkpoint")
        state = get_state()
        rank, world = state.rank, state.world_size
        entries = model_entries(model)
        if meta := meta_names(entries):
            raise CheckpointError(f"cannot save a checkpoint to {directory}: {listed(meta)} are still on the meta device; "
                                  "initialise them first (bmt.init_parameters(model))")
        names, peers = _param_names(entries), _peers(entries)
        entries = with_peers(entries)
        optimizers = optim_state.optimizers_of(optim_manager, optimizer)
        save_id = broadcast_bytes(uuid.uuid4().hex[:12].encode() if rank == 0 else None).decode()
        files = _file_names(rank, world, save_id)
        placement = shard_placement("save_checkpoint layout")
        tp = parallel_layout()
        ranks = ([[0, 0]] * world if tp.tp_size == tp.ep_size == 1
                 else agree(None, [tp.tp_rank, tp.ep_rank], what="TP and EP ranks"))
        tp_ranks, ep_ranks = [r[0] for r in ranks], [r[1] for r in ranks]
        writers = {e.name: _writers(e, world, placement, tp_ranks) for e in entries}
        staged = _own_ranges(entries, writers, rank) if tp.pp_size > 1 or tp.ep_size > 1 else None
        if staged is not None:  # a rank writes what it holds (a pipeline stage's own, the owner of a shared one)
            writers = {e.name: [r[0] < r[1] or (w and e.numel == 0) for r, w in zip(staged[e.name], writers[e.name],
                                                                                     strict=True)] for e in entries}
        tensors = [(f"model/{e.name}", e.local()) for e in entries if writers[e.name][rank]]
        kinds, saved_groups, values = [], [], []
        for k, opt in enumerate(optimizers):
            t, v, kind, groups = optim_state.capture(k, opt, names, peers)
            # Element-wise state is laid out like its parameter: written by the ranks that write that.
            skipped = {optim_state.tensor_key(k, n, key) for n, keys in kind.items()
                       for key, what in keys.items() if what == optim_state.SHARDED and not writers[n][rank]}
            tensors += [(name, x) for name, x in t if name not in skipped]
            values.append(v)
            kinds.append(kind)
            saved_groups.append(groups)
        if peers:
            _peer_kinds(kinds, peers, world)
        rank_state: dict[str, Any] = {"rng": rng.capture(), "values": values}
        if rank == 0:
            rank_state.update(step=step, extra=extra, param_groups=saved_groups, **_manager_state(optim_manager))
        error, written = None, [0] * 4
        try:
            make_dirs(directory)
            state_bytes = torch_bytes(rank_state)
            written = [*_write_tensors(directory / files[0], tensors),
                       write_atomic(directory / files[1], state_bytes), zlib.crc32(state_bytes)]
        except CheckpointError as exc:
            error = str(exc)
        try:
            table = agree(error, written, what="save_checkpoint")
            error = None
            if rank == 0:
                try:
                    metadata = {
                        "format": FORMAT, "version": VERSION, "world_size": world, "save_id": save_id, "step": step,
                        "seed": state.seed, "tp_size": tp.tp_size, "ep_size": tp.ep_size,
                        "files": [dict(zip(("tensors", "state"), _file_names(r, world, save_id), strict=True),
                                       tp_rank=tp_ranks[r], ep_rank=ep_ranks[r],
                                       **dict(zip(_FILE_CHECKS, row, strict=True)))
                                  for r, row in enumerate(table)],
                        "model": [{"names": e.names, "shape": list(e.shape), "dtype": dtype_name(e.dtype),
                                   **_cut(e),
                                   "ranges": staged[e.name] if staged is not None else
                                   _ranges(e, writers[e.name], placement)} for e in entries],
                        "optimizers": [{"class": type(o).__name__, "state": kinds[k]} for k, o in enumerate(optimizers)],
                    }
                    write_atomic(directory / METADATA, json.dumps(metadata, indent=1).encode())
                except CheckpointError as exc:
                    error = str(exc)
            agree(error, what="save_checkpoint")
        except CheckpointError:
            for name in files:  # this save's files are orphans without its metadata: the previous save still rules
                with contextlib.suppress(OSError):  # best effort: the error being raised already says what failed
                    (directory / name).unlink(missing_ok=True)
            raise
        if rank == 0:
            _remove_stale(directory, save_id)


_FILE_CHECKS = ("tensors_bytes", "tensors_crc32", "state_bytes", "state_crc32")  # per rank, in metadata.json


def _write_tensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """Write ``tensors`` to ``path`` (atomically); returns the file's size and CRC-32."""
    writer = SafetensorsWriter(path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors],
                               {"format": FORMAT}, checksum=True)
    try:
        for n, t in tensors:
            writer.put([n], t)
        return writer.commit(), writer.out.crc32
    except BaseException:
        writer.abort()
        raise


def _manager_state(mgr: Any) -> dict[str, Any]:
    if mgr is None:
        return {"loss_scaler": None, "lr_schedulers": []}
    return {"loss_scaler": None if mgr.scaler is None else mgr.scaler.state_dict(),
            "lr_schedulers": [None if s is None else s.state_dict() for s in mgr.lr_schedulers]}


def _remove_stale(directory: Path, save_id: str) -> None:
    """Files of earlier saves and temp files of interrupted ones (a peer died mid-save): unreachable from the
    new metadata. Runs on rank 0 after its own metadata landed, so any metadata temp file left is stale."""
    for f in directory.iterdir():
        ours = f.name.lstrip(".").startswith(("shard-", "state-"))
        if (ours and f".{save_id}." not in f.name) or f.name.startswith(f".{METADATA}.tmp-"):
            f.unlink(missing_ok=True)


# ---- loading -------------------------------------------------------------------------------------------------
class CheckpointReader:
    """The saved checkpoint as this rank needs it: metadata, and the saved ranks' files opened lazily."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        require_directory(directory)
        path = directory / METADATA
        if not path.is_file():
            hint = (" It holds shard files: a save that did not finish." if directory.is_dir()
                    and any(f.name.startswith("shard-") for f in directory.iterdir()) else "")
            raise CheckpointError(f"{path} is missing: {directory} is not a complete bmt_wrap checkpoint.{hint} "
                                  "Resume from an earlier checkpoint")
        with os_errors(path, "read"):
            text = path.read_text()
        try:
            meta = json.loads(text)
            if meta.get("format") != FORMAT or meta.get("version") not in READABLE:
                raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
            self.world = int(meta["world_size"])
            self.tp_size = int(meta.get("tp_size", 1))
            self.ep_size = int(meta.get("ep_size", 1))
            self.files = meta["files"]
            self.entries = {n: m for m in meta["model"] for n in m["names"]}
            self.optimizers = meta["optimizers"]
            self.meta = meta
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} is not a bmt_wrap checkpoint's metadata ({exc}): it may be corrupted; "
                                  "resume from an earlier checkpoint") from exc
        self._tensors: dict[int, SafetensorsSource] = {}
        self._states: dict[int, dict[str, Any]] = {}

    def _checked(self, rank: int, which: str) -> Path:
        path = self.directory / self.files[rank][which]
        with os_errors(path, "read"):
            size = path.stat().st_size
        if size != self.files[rank][f"{which}_bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, {self.files[rank][f'{which}_bytes']} were written: it "
                                  "was truncated or replaced; resume from an earlier checkpoint")
        return path

    def verify(self, ranks: range) -> None:
        """Check saved ranks' files whole: sizes and CRC-32s (none in checkpoints saved before they existed)."""
        for rank in ranks:
            for which in ("tensors", "state"):
                check_crc32(self._checked(rank, which), self.files[rank].get(f"{which}_crc32"))

    def tensors(self, rank: int) -> SafetensorsSource:
        """Saved rank ``rank``'s tensor file (size checked, header parsed)."""
        if rank not in self._tensors:
            path = self._checked(rank, "tensors")
            try:
                self._tensors[rank] = SafetensorsSource(path)
            except Exception as exc:  # noqa: BLE001 - any parse failure: the file is unusable
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); resume from an "
                                      "earlier checkpoint") from exc
        return self._tensors[rank]

    def state(self, rank: int) -> dict[str, Any]:
        """Saved rank ``rank``'s small state (RNG, values; rank 0: groups, scaler, schedulers, step, extra)."""
        if rank not in self._states:
            path = self._checked(rank, "state")
            try:
                self._states[rank] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unpickling failure: the file is unusable
                raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); resume from an "
                                      "earlier checkpoint") from exc
        return self._states[rank]

    def saved_piece(self, saved: dict[str, Any], rank: int) -> Piece:
        """Where saved rank ``rank``'s part of tensor ``saved`` (its metadata entry) sits in the whole."""
        start, end = saved["ranges"][rank]
        if saved.get("ep_dim") is not None:  # an expert tensor: saved rank ``rank``'s experts, then its range
            return Piece(start, end, saved["ep_dim"], self.files[rank]["ep_rank"], self.ep_size)
        return Piece(start, end, saved.get("tp_dim"), self.files[rank].get("tp_rank", 0), self.tp_size,
                     saved.get("tp_parts", 1))

    def pieces(self, name: str, saved: dict[str, Any], mine: Piece) -> Plan:
        """(saved rank, shared boxes) covering ``mine`` of tensor ``saved``; checks the files hold them."""
        shape = tuple(saved["shape"])
        out, covered = [], 0
        for r in range(self.world):
            theirs = self.saved_piece(saved, r)
            pairs = overlaps(shape, mine, theirs)
            if pairs:
                src = self.tensors(r)
                if name not in src.keys() or src.info(name)[0] != (theirs.numel,):
                    raise CheckpointError(f"{src.path} lacks {name!r} (or holds another shape): the checkpoint is "
                                          "corrupted; resume from an earlier checkpoint")
                out.append((r, pairs))
                covered += shared(pairs)
        if covered != mine.numel:
            raise CheckpointError(f"{self.directory / METADATA}: the saved parts of {name!r} cover {covered} "
                                  f"of the {mine.numel} elements this rank needs: the metadata is corrupted; "
                                  "resume from an earlier checkpoint")
        return out

    def _keeper(self, name: str, held: Any) -> int:
        """The saved rank holding parameter ``name``'s whole per-parameter state: rank 0, or for a list expert
        it does not hold, the first rank holding a range of it."""
        if held(0):
            return 0
        return next((r for r, (a, b) in enumerate(self.entries[name]["ranges"]) if a < b), 0)

    def holder(self, name: str, tname: str) -> SafetensorsSource:
        """The saved file holding ``tname``, parameter ``name``'s optimizer state tensor kept whole."""
        src = self.tensors(self._keeper(name, lambda r: tname in self.tensors(r).keys()))
        if tname not in src.keys():
            raise CheckpointError(f"{src.path} lacks {tname!r}: the checkpoint is corrupted")
        return src

    def value(self, k: int, name: str, key: str) -> Any:
        """Optimizer ``k``'s plain state value ``key`` of parameter ``name``, as saved."""
        return self.state(self._keeper(name, lambda r: name in self.state(r)["values"][k]))["values"][k][name][key]

    def read(self, name: str, plan: Plan, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's ``numel`` elements of ``name``, assembled from the saved files ``plan`` names."""
        out = torch.empty(numel, dtype=dtype)
        for r, pairs in plan:
            a, b = span(pairs)
            copy_overlaps(out, self.tensors(r).read(name, a, b), a, pairs)
        return out


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optim_manager: Any = None,
                    optimizer: torch.optim.Optimizer | None = None) -> CheckpointInfo:
    """Restore what ``save_checkpoint`` wrote, at any world size and tensor-parallel size; a collective.

    Everything is validated, and the verdict agreed by all ranks, before anything is read or changed.
    At the saved world size and TP size each rank gets its own RNG states back; at another layout every
    rank reseeds with ``rng.reseed(saved seed, step, rank)``.
    """
    directory = Path(directory)
    with collective_purpose("load_checkpoint", str(directory)):
        state = get_state()
        entries = model_entries(model)
        names, peers = _param_names(entries), _peers(entries)
        entries = with_peers(entries)
        optimizers = optim_state.optimizers_of(optim_manager, optimizer)
        error: CheckpointError | str | None = None
        try:
            reader = CheckpointReader(directory)
            # Each saved rank's files are checked by one rank: at the saved world size, by the rank that reads them.
            reader.verify(range(state.rank, reader.world, state.world_size))
            plan = _plan_model(reader, entries)
            optim_plan = _plan_optimizers(reader, optimizers, entries, names, peers, optim_manager)
            # Each rank's saved RNG state is its own only at the same layout (TP peers draw alike).
            same_world = reader.world == state.world_size and reader.tp_size == parallel_layout().tp_size
            if same_world:
                reader.state(state.rank)
        except CheckpointError as exc:
            error = exc  # its type too: every rank raises a CheckpointCorruptError as such
        agree(error, what="load_checkpoint")
        materialize(entries, state.device)
        error = None
        try:
            for e, name, pieces in plan:
                e.set_local(reader.read(name, pieces, e.piece().numel, e.dtype))
            for k, opt in enumerate(optimizers):
                optim_state.restore(opt, names, reader.state(0)["param_groups"][k], reader.optimizers[k]["state"],
                                    lambda n, key, kind, k=k: optim_plan[(k, n, key)](kind), peers)
            common = reader.state(0)
            if optim_manager is not None:
                if optim_manager.scaler is not None:
                    optim_manager.scaler.load_state_dict(common["loss_scaler"])
                for sched, saved in zip(optim_manager.lr_schedulers, common["lr_schedulers"], strict=True):
                    if sched is not None and saved is not None:
                        sched.load_state_dict(saved)
        except Exception as exc:  # noqa: BLE001 - a failure on one rank must not leave the others waiting
            error = f"cannot restore {directory}: {type(exc).__name__}: {exc}"
        agree(error, what="load_checkpoint")
        step = reader.meta["step"]
        if same_world:
            rng.restore(reader.state(state.rank)["rng"])
        else:
            rng.reseed(reader.meta["seed"], step or 0, state.rank)
        rebuild_lost_buffers(model)
        return CheckpointInfo(step=step, extra=common["extra"], saved_world_size=reader.world, rng_restored=same_world)


def _plan_model(reader: CheckpointReader, entries: list[Entry]) -> list[tuple[Entry, str, Plan]]:
    """For each model tensor, the saved pieces this rank reads; raises naming every mismatch."""
    plan = []
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    for e in entries:
        saved = next((reader.entries[n] for n in e.names if n in reader.entries), None)
        if saved is None:
            missing.append(e.name)
            continue
        used.update(saved["names"])
        if tuple(saved["shape"]) != e.shape or to_dtype(saved["dtype"]) != e.dtype:
            mismatched.append(f"{e.name!r} is {saved['dtype']} {saved['shape']} in the checkpoint but {e.dtype} "
                              f"{list(e.shape)} in the model")
            continue
        if e.absent:  # another EP rank's list expert: this rank reads none of it
            continue
        name = f"model/{saved['names'][0]}"
        plan.append((e, name, reader.pieces(name, saved, e.piece())))
    unexpected = [m["names"][0] for m in reader.meta["model"] if m["names"][0] not in used]
    problems = []
    if missing:
        problems.append(f"model tensors not in the checkpoint: {listed(missing)}")
    if mismatched:
        problems.append(listed(mismatched, 3, str, "; "))
    if unexpected:
        problems.append(f"the checkpoint has tensors the model lacks: {listed(unexpected)}")
    if problems:
        raise CheckpointError(f"{reader.directory} is not a checkpoint of this model: " + "; ".join(problems))
    return plan


def _plan_optimizers(reader: CheckpointReader, optimizers: list[torch.optim.Optimizer], entries: list[Entry],
                     names: dict[int, str], peers: dict[str, list[str]], mgr: Any) -> dict[tuple[int, str, str], Any]:
    """For each saved optimizer state value, a function reading this rank's part; raises on any mismatch."""
    if len(optimizers) != len(reader.optimizers):
        raise CheckpointError(f"{reader.directory} holds state of {len(reader.optimizers)} optimizer(s), "
                              f"{len(optimizers)} were given: pass the same optimizers (optim_manager=, optimizer=)")
    common = reader.state(0)
    if mgr is not None:
        if (mgr.scaler is None) != (common["loss_scaler"] is None):
            raise CheckpointError(f"{reader.directory}: the saved OptimManager and this one disagree on loss scaling "
                                  "(loss_scale=None on exactly one side): build it as the saved one was")
        if len(mgr.lr_schedulers) != len(common["lr_schedulers"]):
            raise CheckpointError(f"{reader.directory}: {len(common['lr_schedulers'])} lr schedulers were saved, "
                                  f"this OptimManager has {len(mgr.lr_schedulers)}")
    by_name = {e.name: e for e in entries}
    readers: dict[tuple[int, str, str], Any] = {}
    for k, opt in enumerate(optimizers):
        why = optim_state.check_groups(k, opt, names, common["param_groups"][k], peers)
        if why:
            raise CheckpointError(f"{reader.directory}: {why}")
        for name, keys in reader.optimizers[k]["state"].items():
            e = by_name[name]
            if e.absent:
                continue
            saved = reader.entries[name]
            for key, kind in keys.items():
                tname = optim_state.tensor_key(k, name, key)
                if kind == optim_state.SHARDED:
                    mine = e.piece()
                    pieces = reader.pieces(tname, saved, mine)
                    dtype = reader.tensors(pieces[0][0]).info(tname)[1] if pieces else e.dtype
                    readers[(k, name, key)] = lambda _kind, t=tname, p=pieces, n=mine.numel, d=dtype: \
                        reader.read(t, p, n, d)
                elif kind == optim_state.REPLICATED:
                    src = reader.holder(name, tname)
                    readers[(k, name, key)] = lambda _kind, t=tname, s=src: _whole(s, t)
                else:
                    value = reader.value(k, name, key)
                    readers[(k, name, key)] = lambda _kind, v=value: v
    return readers


def _whole(src: SafetensorsSource, name: str) -> torch.Tensor:
    shape, _ = src.info(name)
    return src.read(name, 0, math.prod(shape)).reshape(shape).clone()
