"""torch.distributed's own collectives (NCCL on GPU): the backend when CuPy is absent or not wanted."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .base import Communicator, Handle
from .subgroups import GroupRef, process_group_subgroup

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}

# torch 2.13 warns on the *_tensor names in favour of *_single; older releases only have *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _WorkHandle(Handle):
    def __init__(self, comm: TorchCommunicator, work: dist.Work | None, what: str) -> None:
        self._comm, self._work, self._what = comm, work, what

    def wait(self) -> None:
        """Wait with the communicator's timeout; a timeout is fatal."""
        if self._work is None:
            return
        try:
            self._work.wait(self._comm.timeout)
        except RuntimeError as exc:
            raise self._comm.timeout_error(self._what) from exc
        finally:
            self._work = None


class TorchCommunicator(Communicator):
    """Collectives issued straight to a torch.distributed process group (NCCL or gloo)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, timeout: timedelta,
                 backend_name: str, global_ranks: Sequence[int] | None = None) -> None:
        super().__init__(rank, world_size, timeout)
        self._group = GroupRef(group)  # weak: the group dies with destroy_process_group
        self.backend_name = f"torch-{backend_name}"
        self._name = backend_name
        self._global = tuple(global_ranks) if global_ranks is not None else tuple(range(world_size))
        if backend_name == "nccl":  # a group the user made with NCCL alone has no gloo for host tensors
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        return process_group_subgroup(self, self._global, ranks, group, lambda g, rank, size, glob: TorchCommunicator(
            g, rank, size, self.timeout, self._name, global_ranks=glob))

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        work = _all_gather(out, shard, group=self._group(), async_op=True)
        return _WorkHandle(self, work, f"all_gather_into({shard.numel()} x {shard.dtype}) {label}")

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        work = _reduce_scatter(out, full, op=_OPS[op], group=self._group(), async_op=True)
        return _WorkHandle(self, work, f"reduce_scatter_into({out.numel()} x {out.dtype}) {label}")

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        work = dist.all_reduce(tensor, _OPS[op], group=self._group(), async_op=True)
        return _WorkHandle(self, work, f"all_reduce({tensor.numel()} x {tensor.dtype}) {label}")

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        work = dist.broadcast(tensor, self._global[src], group=self._group(), async_op=True)
        return _WorkHandle(self, work, f"broadcast({tensor.numel()} x {tensor.dtype}) {label}")

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self._group, async_op=True)
        return _WorkHandle(self, work, f"all_to_all({inp.numel()} x {inp.dtype}) {label}")

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        work = dist.isend(tensor, self._global[dst], group=self._group(), tag=tag)
        return _WorkHandle(self, work, f"send({tensor.numel()} x {tensor.dtype}) to rank {dst} {label}")

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        work = dist.irecv(tensor, self._global[src], group=self._group(), tag=tag)
        return _WorkHandle(self, work, f"recv({tensor.numel()} x {tensor.dtype}) from rank {src} {label}")

    def _barrier(self, label: str) -> Handle:
        flag = torch.zeros(1, device="cuda" if self.backend_name == "torch-nccl" else "cpu")
        work = dist.all_reduce(flag, group=self._group(), async_op=True)
        return _WorkHandle(self, work, f"barrier {label}")
