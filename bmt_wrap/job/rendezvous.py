"""Where a multi-process job's ranks meet: a fresh key namespace per torchrun attempt, every step timed out.

torchrun's static rendezvous keeps its agent's TCPStore across restarts (``--max-restarts``), so a new
attempt that joins through ``init_method="env://"`` finds the dead attempt's keys (gloo's peer
addresses) and connects to processes that are gone: "Connection refused", or a hang. Measured on 2 ranks
with one killed: 3 of 9 restarts came up under env://, 5 of 5 through a store prefixed by the attempt.
So on torchrun's agent store the ranks meet in ``bmt_wrap/attempt-<TORCHELASTIC_RESTART_COUNT>-world-<WORLD_SIZE>/``:
every attempt (and every world size an elastic job re-forms at) starts from empty keys. Without the agent's
store (no torchrun, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) rank 0 hosts a new store for each launch,
empty already, and the namespace is ``bmt_wrap/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ..errors import InitError


def attempt_namespace(world_size: int, agent_store: bool) -> str:
    """The key prefix this attempt's ranks meet under (the same on every rank of one attempt)."""
    if not agent_store:
        return "bmt_wrap/"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"bmt_wrap/attempt-{restart}-world-{world_size}/"


def _uses_agent_store() -> bool:
    # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; without it rank 0 hosts one (as env:// does).
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


@contextmanager
def _init_errors(step: str, fix: str) -> Iterator[None]:
    """Turn whatever torch raises while joining (timeouts, refused connections) into an ``InitError``."""
    try:
        yield
    except InitError:
        raise
    except Exception as exc:  # noqa: BLE001 - DistStoreError, gloo's RuntimeError, OSError: one meaning here
        raise InitError(f"{step} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                        f"{fix}") from exc


def join_job(backend: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """Create the default process group of this rank through this attempt's namespace; ``InitError`` on any
    failure, after at most ``timeout`` per step."""
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    try:
        port_number = int(port)
    except ValueError:
        raise InitError(f"MASTER_PORT={port!r} is not a port number; launch with torchrun, which sets it") from None
    agent = _uses_agent_store()
    host = "torchrun's agent" if agent else "rank 0"
    seconds = f"{timeout.total_seconds():g} s"
    with _init_errors(f"rank {rank}: connecting to the job's store at {addr}:{port} (hosted by {host})",
                      f"it did not answer within {seconds}. Check that {host} is running and {addr}:{port} is "
                      "reachable from this node (firewall, MASTER_ADDR), or pass init_distributed(timeout=) a "
                      "longer one."):
        # Rank 0 does not wait for its peers here: joining below does, with a message that says so.
        store = dist.TCPStore(addr, port_number, world_size, is_master=not agent and rank == 0, timeout=timeout,
                              multi_tenant=not agent, wait_for_workers=False)
    namespace = attempt_namespace(world_size, agent)
    # Under --rdzv-backend=c10d a node that replaced a lost one counts restarts from 0 while the others do not.
    elastic = (" If a node was replaced under --rdzv-backend=c10d, the nodes may count restarts differently: set "
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that each attempt gets a store of its own." if agent else "")
    with _init_errors(f"rank {rank} of {world_size}: joining the process group under {namespace!r}",
                      f"not every rank of this attempt joined within {seconds}. Look at the other ranks' output "
                      "for the first error (one that died or never started); if the nodes cannot reach each "
                      "other, set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface they share. "
                      f"torchrun --max-restarts then starts a fresh attempt.{elastic}"):
        dist.init_process_group(backend, store=dist.PrefixStore(namespace, store), rank=rank,
                                world_size=world_size, timeout=timeout)
