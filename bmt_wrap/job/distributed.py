"""Distributed state: ``init_distributed`` reads the torchrun environment and builds the communicator.

All of it lives in one ``DistState`` object; everything that needs the rank layout asks it.
"""

from __future__ import annotations

import atexit
import gc
import operator
import os
import random
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..base._compat import default_store, release_group_defaults, release_mesh_groups
from ..base.log import get_logger, set_rank_source
from ..base.mesh import AXES, MeshLayout
from ..errors import NOT_INITIALIZED, BMTError, InitError, MeshError, NotInitializedError
from ..runtime.comm import (
    Communicator,
    CountingCommunicator,
    CupyNcclCommunicator,
    FingerprintCommunicator,
    GlooCommunicator,
    ParallelLayout,
    RankLayout,
    SingleProcessCommunicator,
    TorchCommunicator,
    cupy_available,
)
from ..runtime.sharded_materialize import materialize_stats, reset_materialize_stats
from .rendezvous import join_job

BACKENDS = ("auto", "gloo", "nccl", "cupy")


@dataclass
class DistState:
    """Everything bmt_wrap knows about this process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # resolved: "gloo", "nccl" or "cupy"
    seed: int | None  # None: init_distributed(seed=None) left every RNG as it was
    timeout: timedelta
    debug: bool
    comm: CountingCommunicator
    # The default group at init. Weak: a DistState kept by user code must not keep the group (and gloo's
    # threads) alive past shutdown().
    group: weakref.ref[dist.ProcessGroup] = field(repr=False)
    requested: tuple = field(repr=False, default=())
    owns_group: bool = False  # init_distributed created it, so shutdown() destroys it
    # Each rank layout's communicators, built once (job_layout / build_layout: a test process switches layouts).
    layouts: dict[MeshLayout, ParallelLayout] = field(repr=False, default_factory=dict)
    # init_distributed(pipe_size=, tp_size=)'s layout, and the one models are sharded over now (None: that one).
    default: MeshLayout = field(default_factory=MeshLayout)
    active: MeshLayout | None = None
    micro_batches: int | None = None  # init_distributed(num_micro_batches=): a pipeline block list's; None: P


_STATE: DistState | None = None


def current_state() -> DistState | None:
    """The distributed state, or None before ``init_distributed``."""
    return _STATE


set_rank_source(lambda: _STATE.rank if _STATE is not None else None)


def get_state() -> DistState:
    """The distributed state; raises ``NotInitializedError`` before ``init_distributed``."""
    if _STATE is None:
        raise NotInitializedError(NOT_INITIALIZED)
    return _STATE


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InitError(f"environment variable {name}={value!r} is not an integer") from None


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise InitError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    cuda = torch.cuda.is_available()
    if backend == "auto":
        return "cupy" if cupy_available() else ("nccl" if cuda else "gloo")
    if backend in ("nccl", "cupy") and not cuda:
        raise InitError(f"backend={backend!r} needs a CUDA device and none is visible; use backend='gloo' "
                        "(or 'auto', which picks gloo on CPU machines)")
    if backend == "cupy" and not cupy_available():
        raise InitError("backend='cupy' needs CuPy with NCCL: pip install 'bmt-wrap[gpu]', or use "
                        "backend='nccl' (torch's NCCL) instead")
    return backend


def init_distributed(seed: int | None = 0, backend: str = "auto",
                     timeout: timedelta = timedelta(minutes=5), *, pipe_size: int = 1,
                     tp_size: int = 1, num_micro_batches: int | None = None) -> DistState:
    """Join the torchrun job (or run as one process), seed every RNG and build the communicator.

    ``pipe_size`` and ``tp_size`` are BMTrain's: the job's ranks form ``pipe_size`` pipeline stages of
    ``world / pipe_size`` consecutive ranks (``stage = rank // (world / P)``; ``-1`` means 1), and within a
    stage ``tp_size`` adjacent ranks split each tensor-parallel layer (``tp_rank = rank % T``); ZeRO shards
    over the ranks of one stage with the same ``tp_rank`` (``parallel_layout()``; docs/design.md, "The
    rank layout"). Called again with the same seed, backend and timeout, it only changes these sizes.
    ``seed=None`` seeds nothing: torch, numpy and random stay as they are (the script seeds them itself).
    """
    global _STATE
    pipe_size = 1 if pipe_size == -1 else pipe_size
    seed = _check_seed(seed)
    if num_micro_batches is not None and (not isinstance(num_micro_batches, int) or num_micro_batches < 1):
        raise InitError(f"init_distributed(num_micro_batches={num_micro_batches!r}): a positive int, or None for "
                        "pipe_size micro-batches")
    requested = (seed, backend, timeout)
    if _STATE is not None:
        if _STATE.requested != requested:
            raise InitError(f"init_distributed was already called with (seed, backend, timeout)="
                            f"{_STATE.requested}; calling it again with {requested} is not supported. "
                            "Call it once, at start-up.")
        _use_default(_sized(_STATE.world_size, pipe_size, tp_size, wrapper=False))
        _STATE.micro_batches = num_micro_batches
        return _STATE
    default = _sized(_env_int("WORLD_SIZE", 1), pipe_size, tp_size, wrapper=False)

    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise InitError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    resolved = _resolve_backend(backend)
    debug = os.environ.get("BMT_WRAP_DEBUG", "0") not in ("", "0", "false", "False")

    device = torch.device("cpu")
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
    if resolved in ("nccl", "cupy"):
        device = torch.device("cuda", local_rank)

    owns = False
    if not dist.is_initialized():
        owns = True
        _load_group_capturing_modules()
        if world_size == 1:
            # One process needs no port: an in-memory store is enough for a default group.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            for var in ("MASTER_ADDR", "MASTER_PORT"):
                if var not in os.environ:
                    raise InitError(f"WORLD_SIZE={world_size} but {var} is not set; launch with torchrun, "
                                    "which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
            pg_backend = "cpu:gloo,cuda:nccl" if resolved == "nccl" else "gloo"
            join_job(pg_backend, rank, world_size, timeout)  # a fresh namespace per torchrun attempt
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise InitError(f"an existing process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                        f"but the environment says rank {rank} of {world_size}")

    backend_comm: Communicator
    if world_size == 1:
        backend_comm = SingleProcessCommunicator(timeout)
    elif resolved == "gloo":
        # Each collective first checks that every rank runs the same one (a skipped block is named at
        # once instead of hanging until the timeout); BMT_WRAP_CHECK_COLLECTIVES=0 turns that off.
        check = os.environ.get("BMT_WRAP_CHECK_COLLECTIVES", "1") not in ("", "0", "false", "False")
        backend_comm = GlooCommunicator(None, rank, world_size, timeout, check_order=check)
    elif resolved == "nccl":
        backend_comm = TorchCommunicator(None, rank, world_size, timeout, "nccl")
    else:
        backend_comm = CupyNcclCommunicator(default_store(), rank, world_size, timeout)
    if debug and world_size > 1:
        backend_comm = FingerprintCommunicator(backend_comm)

    seed_everything(seed)
    atexit.register(shutdown)
    _STATE = DistState(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                       backend=resolved, seed=seed, timeout=timeout, debug=debug,
                       comm=CountingCommunicator(backend_comm), requested=requested,
                       group=weakref.ref(dist.group.WORLD), owns_group=owns, micro_batches=num_micro_batches)
    # The runtime gets its communicator from here; it never reads this module's state.
    from ..runtime.active_engine import install_engine
    from ..runtime.engine import Engine  # the engine pulls in autograd machinery: load on use

    install_engine(Engine(_STATE.comm, device, debug=debug))
    _use_default(default)
    get_logger().debug("initialised: %s", _STATE)
    return _STATE


def _load_group_capturing_modules() -> None:
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported.
    # The first wrap imports it (torch.compiler.disable loads torch._dynamo, which loads it), and loaded while
    # our group exists, those defaults keep the group alive after destroy_process_group: gloo's threads then
    # run into interpreter teardown and abort jobs that finished (issue 22). Loaded before the group, the
    # defaults are None ("the default group" at each call). Costs ~10 ms; shutdown() covers the rest.
    import torch.distributed.nn  # noqa: F401


def _use_default(mesh: MeshLayout) -> None:
    """Make ``mesh`` init_distributed's layout and the one models are sharded over (a collective the first
    time: its sub-groups are built)."""
    use_layout(mesh)
    get_state().default = mesh


def _check_seed(seed: Any) -> int | None:
    """``seed`` as an int (numpy's ints included), or None; raises ``InitError`` for anything else."""
    if seed is None:
        return None
    try:
        return operator.index(seed)
    except TypeError:
        raise InitError(f"init_distributed(seed={seed!r}): seed must be an int (the same on every rank), or None "
                        "to leave torch, numpy and random as they are (seeded by the script itself)") from None


def seed_everything(seed: int | None) -> None:
    """Seed torch (CPU and CUDA), numpy and random identically on every rank, as BMTrain does; None: nothing."""
    if seed is None:
        return
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _stop_comm_thread() -> bool:
    """Stop the backend's threads (gloo's worker once its queued ops are done, the NCCL watchdog), the
    mesh sub-groups' first; False if one is stuck in a collective."""
    if _STATE is None:
        return True
    comms = [c for layout in _STATE.layouts.values()
             for c in (layout.tp, layout.dp.shard, layout.dp.replicate, layout.whole, layout.pp, layout.stage,
                       layout.cp)
             if c is not None and c is not _STATE.comm]
    closed = True
    for comm in [*comms, _STATE.comm]:
        inner = comm
        while hasattr(inner, "inner"):
            inner = inner.inner
        closed = inner.close() and closed
    return closed


def shutdown() -> None:
    """Tear down what ``init_distributed`` built; runs at exit by itself, call it to finish earlier."""
    global _STATE
    if _STATE is None:
        return
    # Order matters: the worker thread must leave gloo before its process group goes, and the group must be
    # freed (its C++ destructor joins gloo's threads) before interpreter exit: gloo threads alive during
    # finalisation abort the process ("terminate called without an active exception", SIGABRT) after a job
    # that succeeded. Only a group init_distributed created is destroyed here, and not while a thread is
    # stuck in a collective (a peer died): destroying it underneath would wait on that collective instead of
    # exiting. A destroyed group, ours or the user's, is then freed: torch modules that the first wrap
    # loaded may still hold it.
    from ..runtime.active_engine import install_engine

    group = _STATE.group
    if _stop_comm_thread():
        # The engine and the layouts hold sub-group communicators: drop them before freeing the group.
        install_engine(None)
        _STATE.layouts.clear()
        if _STATE.owns_group and dist.is_initialized() and dist.group.WORLD is group():
            dist.destroy_process_group()
        if not dist.is_initialized() or dist.group.WORLD is not group():
            _free_group(group)
    install_engine(None)
    _STATE = None


def _free_group(group: weakref.ref[dist.ProcessGroup]) -> None:
    """Drop what still holds the destroyed default group, so that it is freed now; warn if it cannot be."""
    if group() is None:
        return
    holders = release_group_defaults(group())  # torch modules loaded after init_distributed hold it
    if not dist.is_initialized():  # every group is gone: a DeviceMesh kept to the end (HSDP) holds them
        release_mesh_groups()
    if group() is not None:
        gc.collect()  # sub-group communicators that held it (tp_size = world size) may sit in a cycle
    if group() is None:
        return
    where = f"default arguments of {', '.join(holders)}" if holders else "a reference outside bmt_wrap"
    get_logger().warning(
        "the default process group was destroyed, but %s still hold(s) it, so gloo's threads keep running; "
        "if they still run at interpreter exit, they can abort this finished job (SIGABRT, \"terminate "
        "called without an active exception\"). Drop that reference before the script ends (wherever torch "
        "takes a group, None means the default one), or import the module that holds it before "
        "bmt.init_distributed().", where)


# ---- the rank layout: the one place that reads keywords and device meshes ------------------------------------
# Axis names a device mesh may carry, outermost first ("dp" is the shard axis of a ("dp", "tp") mesh).
MESH_NAMES = ("pp", "replicate", "shard", "dp", "ep", "cp", "tp")
# Their order, outermost first: an "ep" dim is the fastest-varying part of the shard axis (base/mesh.py).
_MESH_ORDER = ("pp", "replicate", "shard", "ep", "cp", "tp")
_SCOPES = {"tp": "tp", "replicate": "replicate", "pp": "pp"}


def job_layout(mesh: Any = None, *, tp_size: int | None = None, pp_size: int | None = None,
               ep_size: int | None = None, cp_size: int | None = None) -> MeshLayout:
    """The rank layout ``mesh=``, ``tp_size=``, ``pp_size=``, ``ep_size=`` and ``cp_size=`` ask for, checked on
    every rank alike (a collective for a device mesh: every rank must have built the same one).

    Without a mesh: ``init_distributed``'s layout, with ``tp_size``/``pp_size`` in place of its own where
    given. A ``DeviceMesh`` names its dims among ``pp``, ``replicate``, ``shard`` (``dp``), ``ep``, ``cp`` and
    ``tp``, in that order; unnamed, 1-D is ZeRO-3 over it and 2-D (replicate, shard) is HSDP. Only a
    (replicate, shard) mesh may place ranks in any order; the others list them in the default order
    (``base/mesh.py``).
    """
    state = get_state()
    if mesh is None:
        default = state.default
        tp = default.tp if tp_size is None else tp_size
        pp = default.pp if pp_size is None else pp_size
        return _with_ep(_sized(state.world_size, pp, tp, wrapper=True, cp=1 if cp_size is None else cp_size),
                        ep_size)
    problem, layout = None, None
    try:
        layout = _read_mesh(mesh, state, tp_size, pp_size, cp_size)
        if ep_size not in (None, layout.ep):
            if layout.ep > 1:
                raise MeshError(f"ep_size={ep_size} differs from the mesh's 'ep' dimension ({layout.ep}); pass one")
            layout = _with_ep(layout, ep_size)
    except (MeshError, errors.ExpertParallelError) as exc:
        problem = exc
    # Every rank's verdict and its mesh's digest: a rank whose mesh is wrong, or built differently from
    # rank 0's, fails every rank here instead of leaving the others in the first collective over it.
    digest = zlib.crc32(repr(layout).encode()) & 0x7FFFFFFF
    seen = agree(problem, [digest], what="device mesh", error_type=MeshError)
    if any(row != [digest] for row in seen):
        other = next(r for r, row in enumerate(seen) if row != [digest])
        raise MeshError(f"the device mesh differs across ranks (rank {state.rank} has {mesh.mesh.tolist()}, names "
                        f"{tuple(mesh.mesh_dim_names or ())}; rank {other} differs): build it identically on every "
                        "rank, e.g. init_device_mesh(device, (replicas, shard_size), mesh_dim_names=('replicate', "
                        "'shard')).")
    assert layout is not None
    return layout


def _with_ep(layout: MeshLayout, ep_size: int | None) -> MeshLayout:
    """``layout`` with ``ep_size`` of its shard ranks expert-parallel, or ``ExpertParallelError`` (alike on
    every rank: the sizes are the job's)."""
    if ep_size is None or ep_size == layout.ep:
        return layout
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or layout.shard % ep_size:
        raise errors.ExpertParallelError(
            f"ep_size={ep_size!r} must be a positive int dividing the {layout.shard} data-parallel ranks it "
            f"borrows from ({layout.world} ranks: {layout.describe()}): expert parallelism splits each shard "
            "group into groups of ep_size ranks. Use a divisor of it")
    return replace(layout, ep=ep_size)


def _sized(world: int, pp: int, tp: int, wrapper: bool, cp: int = 1) -> MeshLayout:
    """The default-order layout of ``pp`` stages, ``cp``-rank CP groups and ``tp``-rank TP groups, or
    ``InitError`` naming the call that asked for it (the wrapper's ``pp_size=``/``cp_size=``/``tp_size=`` or
    ``init_distributed``'s)."""
    pp_key = "pp_size" if wrapper else "pipe_size"

    def call(**given: Any) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        return f"BMTrainModelWrapper(..., {args})" if wrapper else f"init_distributed({args})"

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world % tp:
        raise InitError(f"{call(tp_size=tp)}: the world size {world} must be a multiple of tp_size (a positive "
                        "int); use a tp_size that divides it")
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1 or world % (pp * tp):
        raise InitError(f"{call(**{pp_key: pp, 'tp_size': tp})}: the world size {world} must be a multiple of "
                        f"{pp_key} x tp_size (a positive int); use sizes whose product divides it")
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or world % (pp * tp * cp):
        raise InitError(f"{call(**{pp_key: pp, 'cp_size': cp, 'tp_size': tp})}: the world size {world} must be a "
                        f"multiple of {pp_key} x cp_size x tp_size (positive ints); use sizes whose product "
                        "divides it")
    return MeshLayout.of(world, pp=pp, cp=cp, tp=tp)


def _read_mesh(mesh: Any, state: DistState, tp_size: int | None, pp_size: int | None,
               cp_size: int | None = None) -> MeshLayout:
    """``mesh`` as a ``MeshLayout``, or ``MeshError`` saying what to build instead (no collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = state.world_size
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"mesh= must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}: "
                        "build one with init_device_mesh('cpu' or 'cuda', (replicas, shard_size), "
                        "mesh_dim_names=('replicate', 'shard'))")
    names = tuple(mesh.mesh_dim_names or ())
    if not names and mesh.ndim > 2:
        raise MeshError(f"mesh= has {mesh.ndim} unnamed dims; bmt_wrap takes a 1-D mesh (ZeRO-3 over it), a 2-D "
                        "(replicate, shard) mesh (HSDP), a 2-D (dp, tp) mesh or a 3-D (replicate, shard, tp) mesh "
                        "(HSDP x TP), with a 'pp' dim first for pipeline stages. Name the dims so, or flatten the "
                        "others into them.")
    names = names or (("shard",) if mesh.ndim == 1 else ("replicate", "shard"))
    axes = tuple("shard" if n == "dp" else n for n in names)
    if (mesh.ndim > 1 and (any(n not in MESH_NAMES for n in names) or list(axes) != sorted(axes, key=_MESH_ORDER.index)
                           or len(set(axes)) != len(axes) or ("dp" in names and "replicate" in names))):
        raise MeshError(f"this mesh names its dims {names}; bmt_wrap reads dims named 'pp', 'replicate', 'shard' "
                        "(or 'dp' without 'replicate'), 'ep', 'cp' and 'tp', outermost first: FSDP2's order for "
                        "HSDP is mesh_dim_names=('replicate', 'shard') with the shard dim last (ranks of one node "
                        "in a row); ('dp', 'tp') or ('replicate', 'shard', 'tp') add TP, ('dp', 'cp') context "
                        "parallelism, and a 'pp' dim goes first.")
    sizes = dict(zip(axes, mesh.mesh.shape, strict=True)) if mesh.ndim > 1 or axes in (("ep",), ("cp",)) else \
        {"shard": mesh.mesh.numel()}
    sizes["shard"] = sizes.get("shard", 1) * sizes.get("ep", 1)  # EP ranks are shard ranks
    grid = [int(r) for r in mesh.mesh.flatten().tolist()]
    if sorted(grid) != list(range(world)):
        raise MeshError(f"mesh= covers ranks {sorted(grid)[:8]}{' ...' if len(grid) > 8 else ''} ({len(grid)} "
                        f"ranks), but the job has {world}: the mesh must cover every rank exactly once "
                        f"(replicas x shard_size = {world}).")
    if mesh.ndim == 1 and grid != list(range(world)):
        raise MeshError(f"a 1-D mesh= must list the ranks in order (0..{world - 1}), got {grid}: it means ZeRO-3 "
                        "over the whole job, whose shards follow the rank order. Pass mesh=None.")
    if axes == ("replicate", "shard", "tp") and sizes["tp"] == 1:
        raise MeshError("a ('replicate', 'shard', 'tp') mesh with a 'tp' dim of 1 has no tensor parallelism: pass "
                        "a 2-D mesh with mesh_dim_names=('replicate', 'shard')")
    hsdp_only = set(axes) <= {"replicate", "shard"}  # an "ep" dim takes ranks in order, as TP does
    if not hsdp_only and grid != list(range(world)):
        raise MeshError(f"a {names} mesh must list ranks in order: TP peers on adjacent ranks, then shard ranks, "
                        "then replicas, then stages (BMTrain's layout: tp_rank = rank % T, stage = rank // "
                        f"(world / P)), i.e. init_device_mesh(device, {tuple(mesh.mesh.shape)}, "
                        f"mesh_dim_names={names})")
    for key, given, axis, form in (("tp_size", tp_size, "tp", "('replicate', 'shard', 'tp')"),
                                   ("pp_size", pp_size, "pp", "('pp', 'replicate', 'shard')"),
                                   ("cp_size", cp_size, "cp", "('dp', 'cp')")):
        if axis in sizes and given not in (None, sizes[axis]):
            raise MeshError(f"{key}={given} differs from the mesh's {axis!r} dimension ({sizes[axis]}); pass one")
        if axis not in sizes and given not in (None, 1):
            raise MeshError(f"{key}={given} with a {names} mesh=: name the {axis!r} dim in the mesh instead, "
                            f"init_device_mesh(device, (..., {given}), mesh_dim_names={form}), and leave {key}= out")
        default = state.default.size(axis)  # init_distributed has no cp_size: its default is 1
        if axis not in sizes and default > 1:
            call = "tp_size" if axis == "tp" else "pipe_size"
            raise MeshError(f"mesh= with init_distributed({call}={default}): models are laid out over the "
                            f"groups that {call}= defines; leave mesh= out, or name a {axis!r} dim in the mesh")
    return MeshLayout(**{a: int(sizes.get(a, 1)) for a in AXES}, grid=tuple(grid), ep=int(sizes.get("ep", 1)))


def build_layout(mesh: MeshLayout) -> ParallelLayout:
    """This rank's communicators for ``mesh``, built once per layout (a collective the first time: every
    rank creates every group, in the same order)."""
    state = get_state()
    if mesh in state.layouts:
        return state.layouts[mesh]
    # One communicator per set of ranks and scope: the same ranks under two axes (shard x tp of one shard
    # rank is the TP group) count their traffic apart.
    made: dict[tuple[tuple[int, ...], str], Communicator] = {}

    def along(axes: tuple[str, ...] | Callable[[int], tuple[int, ...]], scope: str) -> Communicator:
        group_of = axes if callable(axes) else (lambda r: mesh.group(r, axes))
        ranks = group_of(state.rank)
        if axes == mesh.zero_axes() and ranks == tuple(range(state.world_size)):
            return state.comm  # ZeRO-3 over the whole job: the job's own communicator (one rank: counted too)
        if (ranks, scope) not in made:
            if len(ranks) == 1:
                made[ranks, scope] = SingleProcessCommunicator(state.timeout)
            else:
                # every rank, every group; with the job's timeout, not torch's 30 minutes: torch's own waits
                # on them (a pipeline schedule's transfers) pass none
                groups = {g: dist.new_group(list(g), timeout=state.timeout) for g in mesh.every(group_of)}
                made[ranks, scope] = state.comm.subgroup_counted(ranks, groups[ranks], scope)
        return made[ranks, scope]

    shard_scope = "shard" if mesh.replicate > 1 else "dp"
    # Built in the same order on every rank (NCCL backends need it): tp, shard, replicate, whole, pp, stage,
    # ep, experts, cp.
    tp = along(("tp",), "tp")
    # CP peers hold the same parameters: ZeRO shards over them too, and the loss's backward scales by C so the
    # group's average sums their parts (runtime/context_parallel.slice_loss); under TP, so does ``whole``.
    shard = along(mesh.zero_axes(), shard_scope)
    replicate = along(("replicate",), "replicate") if mesh.replicate > 1 else None
    whole = along(mesh.zero_axes(whole_on_tp=True), shard_scope) if mesh.tp > 1 else None
    pp = along(("pp",), "pp") if mesh.pp > 1 else None
    stage = along(("replicate", "shard", "cp", "tp"), "stage") if mesh.pp > 1 else None
    ep, experts = None, None
    if mesh.ep > 1:  # then the experts' owners (ZeRO-3 over them), after every other group
        ep = along(mesh.ep_group, "ep")
        experts = RankLayout(along(mesh.expert_shard_group, "experts"), replicate)
    cp = along(("cp",), "cp") if mesh.cp > 1 else None  # the ranks splitting one sequence
    layout = ParallelLayout(mesh, state.rank, tp, RankLayout(shard, replicate), whole, pp, stage, ep, experts, cp)
    state.layouts[mesh] = layout
    return layout


def use_layout(mesh: MeshLayout) -> ParallelLayout:
    """Make ``mesh`` the layout models are sharded over from now on (the engine adopts it; refused while
    models of another layout live) and return its communicators."""
    from ..runtime.active_engine import get_engine  # the engine loads autograd machinery: load on use

    layout = build_layout(mesh)
    get_engine().adopt_layout(layout)
    get_state().active = mesh
    return layout


def parallel_layout() -> ParallelLayout:
    """This rank's place in the job's layout: its communicators along every axis (``init_distributed``'s
    ``pipe_size=``/``tp_size=``, or what the last wrapped model asked for). Not a collective."""
    state = get_state()
    return build_layout(state.active or state.default)


#: Its name before pipeline parallelism (issue 28): the same layout, read for its TP group.
tensor_parallel = parallel_layout


def data_parallel_rank() -> int:
    """Which slice of the global batch this rank takes: TP peers, CP peers and the stages of one pipeline
    take the same one (``data_parallel_size()`` slices in all)."""
    return parallel_layout().dp_rank


def data_parallel_size() -> int:
    """How many slices the global batch is cut into (ranks / (pipeline stages x CP size x TP size))."""
    return parallel_layout().dp_size


def _active_layout() -> RankLayout:
    """The layout this process's wrapped models are sharded over (the engine adopted it at wrap time)."""
    from ..runtime.active_engine import get_engine  # the engine loads autograd machinery: load on use

    return get_engine().layout


def writes_for_all() -> bool:
    """True on the one rank that writes files every rank's data goes into (rank 0 of the first replica)."""
    layout = _active_layout()
    if layout.replicate is None:
        return get_state().rank == 0
    # Under HSDP x TP each TP peer of that replica's shard rank 0 holds it too: one of them writes.
    return layout.shard_rank == 0 and layout.replica_rank == 0 and parallel_layout().tp_rank == 0


def in_first_replica() -> bool:
    """True on the ranks of the first replica: gathering the whole model there is enough to write it."""
    return _active_layout().replica_rank == 0


def shard_placement(what: str) -> list[tuple[int, int]] | None:
    """Every rank's (shard rank, replica rank) under a mesh (one all-reduce), or None without one, where
    rank r holds shard r; ``what`` labels the collective."""
    layout = _active_layout()
    if layout.replicate is None and layout.shard is get_state().comm:
        return None
    table = agree(None, [layout.shard_rank, layout.replica_rank], what=what)
    return [(shard, replica) for shard, replica in table]


def comm() -> CountingCommunicator:
    """The job's communicator."""
    return get_state().comm


def rank() -> int:
    """This process's rank."""
    return get_state().rank


def world_size() -> int:
    """Number of ranks in the job."""
    return get_state().world_size


def local_rank() -> int:
    """This process's rank on its node."""
    return get_state().local_rank


def is_initialized() -> bool:
    """True once ``init_distributed`` has run."""
    return _STATE is not None


def print_rank(*args: object, rank: int = 0) -> None:
    """Log ``args`` (joined by spaces) from one rank only."""
    if get_state().rank == rank:
        get_logger().info(" ".join(str(a) for a in args))


def barrier() -> None:
    """Wait until every rank got here."""
    get_state().comm.barrier()


def synchronize() -> None:
    """Finish this rank's queued GPU work, then wait for every rank."""
    state = get_state()
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    state.comm.barrier(label="synchronize")


def sum_loss(loss: torch.Tensor) -> torch.Tensor:
    """Mean of ``loss`` over ranks (BMTrain's name), detached; every rank gets the same value."""
    state = get_state()
    flat = loss.detach().reshape(1).to(torch.float32).clone()
    state.comm.all_reduce(flat, "avg", label="sum_loss")
    return flat.reshape(loss.shape).to(loss.dtype)


def comm_stats(by_group: bool = False) -> dict[str, Any]:
    """Calls and algorithmic bytes per collective since the last reset: op -> {"calls", "bytes"}; with
    ``by_group``, per group scope first ("world", and under a mesh "shard" and "replicate")."""
    comm = get_state().comm
    stats = comm.by_scope() if by_group else comm.snapshot()
    materialized = materialize_stats()
    if materialized["calls"]:  # ops that gathered a sharded tensor's full value (runtime/sharded_materialize.py)
        stats["materialize"] = materialized
    return stats


def reset_comm_stats() -> None:
    """Zero the collective counters."""
    get_state().comm.reset()
    reset_materialize_stats()


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src``'s bytes on every rank (two broadcasts: length, then payload)."""
    state = get_state()
    if state.world_size == 1:
        assert data is not None
        return data
    length = torch.tensor([len(data) if state.rank == src and data is not None else 0], dtype=torch.int64,
                          device=state.device)
    state.comm.broadcast(length, src, label="object length")
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=state.device)
    if state.rank == src and data is not None:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    state.comm.broadcast(payload, src, label="object")
    return bytes(payload.cpu().numpy().tobytes())


def agree(error: BaseException | str | None, payload: list[int] | None = None, what: str = "verdict",
          error_type: type[BMTError] = BMTError) -> list[list[int]]:
    """Raise on every rank if any rank passes an ``error``; else return every rank's ``payload``.

    A rank that failed on its own (planning on rank 0, a file it cannot read) must not leave the others
    waiting in the next collective. One all-reduce; only on failure, the first failing rank's message is
    broadcast (two more). That rank re-raises its own exception; the others raise the same bmt_wrap type
    when it is one (else ``error_type``), with its message. A string ``error`` raises ``error_type``.
    ``what`` labels the collective, so it must be the same on every rank (no path: see ``collective_purpose``).
    """
    state = get_state()
    payload = payload or []
    width = 1 + len(payload)
    table = torch.zeros(state.world_size * width, dtype=torch.int64, device=state.device)
    table[state.rank * width] = int(error is not None)
    table[state.rank * width + 1:(state.rank + 1) * width] = torch.tensor(payload, dtype=torch.int64)
    if state.world_size > 1:
        state.comm.all_reduce(table, "sum", label=f"{what} verdict")
    rows = table.cpu().view(state.world_size, width).tolist()
    failed = [r for r, row in enumerate(rows) if row[0]]
    if not failed:
        return [row[1:] for row in rows]
    first = failed[0]
    mine = None
    if state.rank == first:
        mine = f"{type(error).__name__}\n{error}" if isinstance(error, BaseException) else f"\n{error}"
    name, _, message = broadcast_bytes(mine.encode() if mine else None, src=first).decode().partition("\n")
    if state.rank == first and isinstance(error, BaseException):
        raise error
    cls = getattr(errors, name, None)
    cls = cls if isinstance(cls, type) and issubclass(cls, BMTError) else error_type
    if state.rank != first:
        message = f"rank {first}: {name + ': ' if cls is error_type and name else ''}{message}"
    raise cls(message)


_COLLECTIVES = frozenset({"all_gather", "all_reduce", "broadcast", "reduce_scatter", "send_activations",
                          "recv_activations"})


def __getattr__(name: str) -> Any:
    """BMTrain's differentiable ``bmt.distributed.*`` ops, from ``collectives`` (which builds on this module,
    so it is loaded on first use rather than imported here)."""
    if name in _COLLECTIVES:
        from . import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'bmt_wrap.distributed' has no attribute {name!r}")
