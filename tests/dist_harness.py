"""Run a test body on N real processes (gloo over loopback), with one persistent worker group per size.

Spawning a group costs seconds (torch import + gloo init), so each world size gets one group for the
whole pytest session; test bodies (module-level functions, pickled by reference) are sent to it. A
failure on any rank raises in the test with every rank's traceback, and the group is rebuilt, since a
failed collective may leave it unusable.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
COMM_TIMEOUT = timedelta(seconds=60)

_GROUPS: dict[int, _WorkerGroup] = {}
#: Every worker group started this session: (world size, seconds to ready, the test that needed it).
STARTS: list[tuple[int, float, str]] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1 if world_size > 1 else 2)
    import bmt_wrap as bmt
    from bmt_wrap import distributed

    try:
        bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT)
    except BaseException:
        conn.send(("err", traceback.format_exc(), "init"))
        return
    conn.send(("ready", None, None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, qualname, args, kwargs = msg
        state = distributed.get_state()
        state.comm.timeout = COMM_TIMEOUT
        state.comm.reset()
        distributed.seed_everything(0)
        try:
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            result = fn(*args, **kwargs)
            conn.send(("ok", result, state.comm.broken))
        except BaseException as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", state.comm.broken))
        finally:
            _reset_engine()
            _drop_subgroups()
            # A body that asked for tensor parallelism (init_distributed(tp_size=T)) leaves the next one
            # the plain layout; the TP sub-groups stay built for the next body that asks.
            bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=1)
    distributed.shutdown()


def _drop_subgroups() -> None:
    """Destroy the process groups a body built (its layouts', a DeviceMesh's) and forget its layouts."""
    # gloo wakes a thread per process group, idle or not: a worker keeping every body's groups held 29 of them
    # on 8 ranks and dozens on 4, and the idle groups' wake-ups cost the session as much system time as
    # whole test files. The next body that wants a layout builds its groups again, in milliseconds.
    import torch.distributed as dist

    from bmt_wrap.job import distributed

    distributed.get_state().layouts.clear()
    for group in list(dist.distributed_c10d._world.pg_map):  # torch has no public list of the groups
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def _reset_engine() -> None:
    # Test bodies must not leak per-process engine state into the next body.
    try:
        from bmt_wrap.runtime import process_engine as engine
    except ImportError:
        return
    reset = getattr(engine, "reset_engine", None)
    if reset is not None:
        reset()


class _WorkerGroup:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        port = _free_port()
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, world_size, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(120):
                self.kill()
                raise RuntimeError(f"worker rank {rank} of {world_size} did not start within 120 s")
            kind, payload, _ = conn.recv()
            if kind != "ready":
                self.kill()
                raise RuntimeError(f"worker rank {rank} failed to initialise:\n{payload}")

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> tuple[list, bool]:
        msg = (fn.__module__, fn.__qualname__, args, kwargs)
        for conn in self.conns:
            conn.send(msg)
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        healthy = True
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                errors.append(f"rank {rank}: no result within {timeout:.0f} s (hung); killed the group")
                healthy = False
                continue
            try:
                kind, payload, broken = conn.recv()
            except EOFError:
                errors.append(f"rank {rank}: worker process died (exit code {self.procs[rank].exitcode})")
                healthy = False
                continue
            if broken:
                healthy = False
            if kind == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                healthy = False
        if errors:
            raise DistributedTestError(results, errors)
        return results, healthy

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


class DistributedTestError(AssertionError):
    """A test body failed on at least one rank; carries each rank's traceback and partial results."""

    def __init__(self, results: list, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.results = results
        self.errors = errors


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a persistent group of ``world_size``; return results."""
    group = _GROUPS.get(world_size)
    if group is None or not group.alive():
        if group is not None:
            group.kill()
        started = time.perf_counter()
        group = _GROUPS[world_size] = _WorkerGroup(world_size)
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        STARTS.append((world_size, time.perf_counter() - started, test))
    try:
        results, healthy = group.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        group.kill()
        del _GROUPS[world_size]
        raise
    if not healthy:
        group.kill()
        del _GROUPS[world_size]
    return results


def shutdown_all(keep: tuple[int, ...] = ()) -> None:
    """Stop every worker group but those of the world sizes in ``keep`` (all of them: the session's end)."""
    for size in [s for s in _GROUPS if s not in keep]:
        _GROUPS.pop(size).close()


def raised(fn: Callable[[], Any]) -> tuple[str, str]:
    """The type name and message of what ``fn()`` raised on this rank, or ``("ok", "")``: a body returns
    this so the test compares what every rank got, where one rank's traceback would hide the others'."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        return type(exc).__name__, str(exc)
    return "ok", ""
