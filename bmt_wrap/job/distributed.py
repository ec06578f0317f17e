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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..base._compat import default_store, release_group_defaults, release_mesh_groups
from ..base.log import get_logger, set_rank_source
from ..errors import NOT_INITIALIZED, BMTError, InitError, MeshError, NotInitializedError, UnsupportedError
from ..runtime.comm import (
    Communicator,
    CountingCommunicator,
    CupyNcclCommunicator,
    FingerprintCommunicator,
    GlooCommunicator,
    RankLayout,
    SingleProcessCommunicator,
    TensorParallelLayout,
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
    # Rank layouts built from device meshes, by the mesh's ranks: each mesh's sub-group communicators once.
    layouts: dict[tuple, RankLayout] = field(repr=False, default_factory=dict)
    tp_size: int = 1  # init_distributed(tp_size=): ranks each tensor-parallel layer is split over
    tp_replicas: int = 1  # under a 3-D mesh= with TP: HSDP replicas of the (shard x tp) model
    # Tensor-parallel layouts by (tp_size, replicas), each built once (its sub-group communicators and mesh).
    tp_layouts: dict[tuple[int, int], TensorParallelLayout] = field(repr=False, default_factory=dict)


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
                     tp_size: int = 1) -> DistState:
    """Join the torchrun job (or run as one process), seed every RNG and build the communicator.

    ``tp_size`` is BMTrain's: T adjacent ranks split each tensor-parallel layer (``tp_rank = rank % T``)
    and ZeRO shards over the ``world / T`` ranks of the same ``tp_rank`` (``tensor_parallel()``).
    ``pipe_size`` is BMTrain's too: 1 (or ``-1``, no pipeline) is the only value.
    ``seed=None`` seeds nothing: torch, numpy and random stay as they are (the script seeds them itself).
    """
    global _STATE
    _check_pipe_size(pipe_size)
    seed = _check_seed(seed)
    requested = (seed, backend, timeout)
    if _STATE is not None:
        if _STATE.requested != requested:
            raise InitError(f"init_distributed was already called with (seed, backend, timeout)="
                            f"{_STATE.requested}; calling it again with {requested} is not supported. "
                            "Call it once, at start-up.")
        _use_tensor_parallel(tp_size)
        return _STATE
    if not isinstance(tp_size, int) or tp_size < 1 or _env_int("WORLD_SIZE", 1) % tp_size:
        raise InitError(f"init_distributed(tp_size={tp_size!r}): the world size {_env_int('WORLD_SIZE', 1)} "
                        f"must be a multiple of tp_size (a positive int); use a tp_size that divides it")

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
                       group=weakref.ref(dist.group.WORLD), owns_group=owns)
    # The runtime gets its communicator from here; it never reads this module's state.
    from ..runtime.active_engine import install_engine
    from ..runtime.engine import Engine  # the engine pulls in autograd machinery: load on use

    install_engine(Engine(_STATE.comm, device, debug=debug))
    _use_tensor_parallel(tp_size)
    get_logger().debug("initialised: %s", _STATE)
    return _STATE


def _load_group_capturing_modules() -> None:
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported.
    # The first wrap imports it (torch.compiler.disable loads torch._dynamo, which loads it), and loaded while
    # our group exists, those defaults keep the group alive after destroy_process_group: gloo's threads then
    # run into interpreter teardown and abort jobs that finished (issue 22). Loaded before the group, the
    # defaults are None ("the default group" at each call). Costs ~10 ms; shutdown() covers the rest.
    import torch.distributed.nn  # noqa: F401


def _check_pipe_size(pipe_size: int) -> None:
    if pipe_size not in (1, -1):
        raise UnsupportedError(
            f"init_distributed(pipe_size={pipe_size}): bmt_wrap has no pipeline parallelism, only ZeRO-3 "
            "data parallelism (with tensor parallelism by tp_size=). Use pipe_size=1 (every rank holds a 1/N "
            "shard of every layer; memory per rank falls with the number of ranks as with BMTrain's ZeRO).")


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
    comms = [c for layout in _STATE.layouts.values() for c in (layout.shard, layout.replicate) if c is not None]
    comms += [c for tp in _STATE.tp_layouts.values() for c in (tp.tp, tp.dp.shard, tp.dp.replicate)
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
        # The engine and the TP layouts hold sub-group communicators, and a mesh dim over every rank (tp_size
        # = world size) is the default group itself: drop them before freeing it.
        install_engine(None)
        _STATE.tp_layouts.clear()
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


# ---- the rank layout: the one place that reads a device mesh ------------------------------------------------
MESH_DIMS = ("replicate", "shard")


def rank_layout(mesh: Any = None) -> RankLayout:
    """This rank's shard and replicate groups for ``mesh`` (a collective on first use of a mesh).

    None, or a 1-D mesh over every rank: ZeRO-3 over the whole job. A 2-D ``DeviceMesh`` with dims
    (replicate, shard), FSDP2's convention: parameters sharded over the shard dim (ranks in one row),
    replicated across the replicate dim (one column). Checked on every rank before any group is built.
    """
    state = get_state()
    if mesh is None:
        return tensor_parallel().dp
    if state.tp_size > 1:
        raise MeshError(f"mesh= with init_distributed(tp_size={state.tp_size}): models are sharded over the "
                        "data-parallel group that tp_size= defines; leave mesh= out")
    ranks = _mesh_ranks(mesh, state.world_size)
    key = (tuple(map(tuple, ranks)), tuple(mesh.mesh_dim_names or ()))
    digest = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    seen = agree(None, [digest], what="device mesh", error_type=MeshError)
    if any(row != [digest] for row in seen):
        other = next(r for r, row in enumerate(seen) if row != [digest])
        raise MeshError(f"the device mesh differs across ranks (rank {state.rank} has {key[0]}, names "
                        f"{key[1]}; rank {other} differs): build it identically on every rank, e.g. "
                        "init_device_mesh(device, (replicas, shard_size), mesh_dim_names=('replicate', 'shard')).")
    if ranks == [list(range(state.world_size))]:
        return RankLayout(state.comm)
    if key not in state.layouts:
        row = next(r for r in ranks if state.rank in r)
        column = [r[row.index(state.rank)] for r in ranks]
        # Shard group first, then replicate, on every rank: NCCL backends build them in that order.
        shard = state.comm.subgroup_counted(tuple(row), _mesh_group(mesh, 1, row), "shard")
        replicate = None
        if len(column) > 1:
            replicate = state.comm.subgroup_counted(tuple(column), _mesh_group(mesh, 0, column), "replicate")
        state.layouts[key] = RankLayout(shard, replicate)
    return state.layouts[key]


# ---- tensor parallelism: the TP group and the data-parallel group ZeRO shards over ---------------------------
TP_MESH_DIMS = ("dp", "tp")
MESH_3D_DIMS = ("replicate", "shard", "tp")


def tensor_parallel() -> TensorParallelLayout:
    """This rank's tensor-parallel layout (``init_distributed(tp_size=)`` or a TP ``mesh=``; else the plain one)."""
    state = get_state()
    return state.tp_layouts.get((state.tp_size, state.tp_replicas)) or _tp_layout(state, 1, 1)


def mesh_tensor_parallel(mesh: Any, tp_size: int | None) -> TensorParallelLayout | None:
    """The TP layout ``mesh=`` and ``tp_size=`` ask for (a collective on first use), or None when ``mesh=``
    is HSDP's or ZeRO's without TP (``rank_layout`` reads it then).

    A ("dp", "tp") mesh, or a ("replicate", "shard", "tp") mesh: HSDP across the replicate dim, ZeRO-3
    within a shard group, TP within a node. Either way TP peers are adjacent ranks (``tp_rank = rank % T``,
    BMTrain's layout), then shard ranks, then replicas. ``tp_size`` alone: init_distributed's when None.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    if mesh is not None and names not in (TP_MESH_DIMS, MESH_3D_DIMS):
        if tp_size not in (None, 1):
            raise MeshError(f"tp_size={tp_size} with a {names or 'unnamed'} mesh= (HSDP): name the TP dim in the "
                            "mesh instead, init_device_mesh(device, (replicas, shard_size, tp_size), "
                            "mesh_dim_names=('replicate', 'shard', 'tp')), and leave tp_size= out")
        return None
    replicas = 1
    if mesh is not None:
        t = mesh.size(mesh.ndim - 1)
        if tp_size not in (None, t):
            raise MeshError(f"tp_size={tp_size} differs from the mesh's 'tp' dimension ({t}); pass one")
        if mesh.mesh.flatten().tolist() != list(range(get_state().world_size)):
            raise MeshError(f"a {names} mesh must put TP peers on adjacent ranks, then shard ranks, then "
                            "replicas (BMTrain's layout: tp_rank = rank % T), i.e. init_device_mesh(device, "
                            f"{'(world // T, T)' if len(names) == 2 else '(replicas, shard_size, T)'}, "
                            f"mesh_dim_names={names})")
        if len(names) == 3:
            replicas = mesh.size(0)
            if t == 1:
                raise MeshError("a ('replicate', 'shard', 'tp') mesh with a 'tp' dim of 1 has no tensor "
                                "parallelism: pass a 2-D mesh with mesh_dim_names=('replicate', 'shard')")
        tp_size = t
    if tp_size is None:
        return tensor_parallel()
    call = f"BMTrainModelWrapper(..., {'mesh=...' if mesh is not None else f'tp_size={tp_size!r}'})"
    return use_tensor_parallel(tp_size, replicas, call=call)


def _tp_layout(state: DistState, tp_size: int, replicas: int) -> TensorParallelLayout:
    """The layout for ``tp_size`` and ``replicas`` (HSDP replicas of the shard x tp model), built once per
    pair (a collective on every rank the first time)."""
    key = (tp_size, replicas)
    if key in state.tp_layouts:
        return state.tp_layouts[key]
    if key == (1, 1):
        layout = TensorParallelLayout(SingleProcessCommunicator(state.timeout), RankLayout(state.comm))
    else:
        from torch.distributed.device_mesh import init_device_mesh

        shard_size = state.world_size // (tp_size * replicas)
        # BMTrain's layout: TP peers adjacent (the mesh's last dim is runs of tp_size ranks), then shard
        # ranks; replicas are the outermost dim (FSDP2's HSDP order: one replica per node group).
        shape, names = ((shard_size, tp_size), TP_MESH_DIMS) if replicas == 1 else \
            ((replicas, shard_size, tp_size), MESH_3D_DIMS)
        mesh = init_device_mesh(state.device.type, shape, mesh_dim_names=names)
        tp_rank, shard_rank = state.rank % tp_size, (state.rank // tp_size) % shard_size
        first = state.rank - tp_rank - shard_rank * tp_size  # this replica's rank 0
        row = tuple(state.rank - tp_rank + i for i in range(tp_size))
        column = tuple(first + i * tp_size + tp_rank for i in range(shard_size))
        across = tuple(i * shard_size * tp_size + state.rank - first for i in range(replicas))
        # Built in the same order on every rank (NCCL backends need it): tp, shard, replicate.
        tp = state.comm.subgroup_counted(row, mesh.get_group("tp"), "tp")
        shard_scope = "dp" if replicas == 1 else "shard"
        shard = state.comm.subgroup_counted(column, mesh.get_group(names[-2]), shard_scope) if shard_size > 1 \
            else SingleProcessCommunicator(state.timeout)
        replicate = state.comm.subgroup_counted(across, mesh.get_group("replicate"), "replicate") \
            if replicas > 1 else None
        # The ranks of this replica (shard x tp), which parameters every TP peer holds whole are sharded
        # over (#38 item 5); counted with the shard group's traffic, the ZeRO axis. Every rank creates
        # every replica's group, in replica order (torch's new_group is a collective over the world).
        per_replica = shard_size * tp_size
        groups = [dist.new_group(list(range(i * per_replica, (i + 1) * per_replica))) for i in range(replicas)]
        mine = tuple(range(first, first + per_replica))
        whole = state.comm.subgroup_counted(mine, groups[state.rank // per_replica], shard_scope)
        layout = TensorParallelLayout(tp, RankLayout(shard, replicate), whole)
    state.tp_layouts[key] = layout
    return layout


def _use_tensor_parallel(tp_size: int, replicas: int = 1, call: str | None = None) -> None:
    """Make ``tp_size`` (and ``replicas``) the job's TP layout: new shard groups are built over its dp group.
    ``call`` is the user's call that asked for it, for messages (default: ``init_distributed``'s)."""
    state = get_state()
    call = call or f"init_distributed(tp_size={tp_size!r})"
    if not isinstance(tp_size, int) or tp_size < 1 or state.world_size % tp_size:
        raise InitError(f"{call}: the world size {state.world_size} must be a multiple of tp_size (a positive "
                        "int); use a tp_size that divides it")
    from ..runtime.active_engine import get_engine

    engine = get_engine()
    layout = _tp_layout(state, tp_size, replicas)
    if engine.groups and engine.layout != layout.dp:
        raise InitError(f"{call}: tensor parallelism over {tp_size} ranks x {replicas} replica(s) while models "
                        f"sharded under tp_size={state.tp_size} x {state.tp_replicas} replica(s) live: call "
                        "init_distributed once, at start-up, before building any model, and wrap every model "
                        "with the same tp_size= and mesh=")
    state.tp_size, state.tp_replicas = tp_size, replicas
    engine.adopt_layout(layout.dp, layout.tp, layout.whole)


def use_tensor_parallel(tp_size: int, replicas: int = 1, call: str | None = None) -> TensorParallelLayout:
    """``init_distributed(tp_size=)`` after start-up (``BMTrainModelWrapper(model, tp_size=T)``, or ``replicas``
    HSDP replicas under a 3-D ``mesh=``): make it the job's TP layout and return it; a collective on first use.
    ``call`` names the user's call in errors (default: ``init_distributed``)."""
    _use_tensor_parallel(tp_size, replicas, call)
    return tensor_parallel()


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
    return layout.shard_rank == 0 and layout.replica_rank == 0 and tensor_parallel().tp_rank == 0


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


def _mesh_ranks(mesh: Any, world: int) -> list[list[int]]:
    """The mesh's ranks as rows of shard groups (one row for a 1-D mesh); raises ``MeshError`` unless
    it is a 1-D or (replicate, shard) 2-D mesh over every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"mesh= must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}: "
                        "build one with init_device_mesh('cpu' or 'cuda', (replicas, shard_size), "
                        "mesh_dim_names=('replicate', 'shard'))")
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh.mesh.tolist()
    if mesh.ndim == 1:
        rows = [grid]
    elif mesh.ndim == 2:
        if names and names != MESH_DIMS:
            raise MeshError(f"a 2-D mesh's dims are (replicate, shard), FSDP2's order; this mesh names them "
                            f"{names}. Build it with mesh_dim_names=('replicate', 'shard') and the shard "
                            "dim last (ranks of one node in a row).")
        rows = grid
    else:
        raise MeshError(f"mesh= has {mesh.ndim} dims {names or ''}; bmt_wrap takes a 1-D mesh (ZeRO-3 over it), "
                        "a 2-D (replicate, shard) mesh (HSDP), a 2-D (dp, tp) mesh or a 3-D (replicate, shard, "
                        "tp) mesh (HSDP x TP). Name the dims so, or flatten the others into them.")
    flat = sorted(r for row in rows for r in row)
    if flat != list(range(world)):
        raise MeshError(f"mesh= covers ranks {flat[:8]}{' ...' if len(flat) > 8 else ''} ({len(flat)} ranks), but "
                        f"the job has {world}: the mesh must cover every rank exactly once "
                        f"(replicas x shard_size = {world}).")
    if mesh.ndim == 1 and grid != list(range(world)):
        raise MeshError(f"a 1-D mesh= must list the ranks in order (0..{world - 1}), got {grid}: it means ZeRO-3 "
                        "over the whole job, whose shards follow the rank order. Pass mesh=None.")
    return rows


def _mesh_group(mesh: Any, dim: int, ranks: list[int]) -> dist.ProcessGroup:
    """The mesh's process group along ``dim`` that holds this rank, checked to be ``ranks``."""
    group = mesh.get_group(dim)
    if dist.get_process_group_ranks(group) != ranks:
        raise MeshError(f"the mesh's group along dim {dim} holds ranks {dist.get_process_group_ranks(group)}, "
                        f"expected {ranks}")
    return group


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


_COLLECTIVES = frozenset({"all_gather", "all_reduce", "broadcast", "reduce_scatter"})


def __getattr__(name: str) -> Any:
    """BMTrain's differentiable ``bmt.distributed.*`` ops, from ``collectives`` (which builds on this module,
    so it is loaded on first use rather than imported here)."""
    if name in _COLLECTIVES:
        from . import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'bmt_wrap.distributed' has no attribute {name!r}")
