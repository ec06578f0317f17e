"""Sub-groups of backends that run on torch process groups (gloo, torch's NCCL): the checks they share."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ...errors import CommError
from .base import Communicator
from .single import SingleProcessCommunicator


def process_group_subgroup(parent: Communicator, global_ranks: Sequence[int], ranks: tuple[int, ...], group: Any,
                           build: Callable[[Any, int, int, list[int]], Communicator]) -> Communicator:
    """``build(group, rank, size, global ranks)`` for ``ranks`` of ``parent`` (whose ranks map to
    ``global_ranks``); a single rank needs no process group."""
    if len(ranks) == 1:
        return SingleProcessCommunicator(parent.timeout)
    if group is None:
        raise CommError(f"a {parent.backend_name} sub-group of ranks {ranks} needs its torch process group (group=)")
    return build(group, ranks.index(parent.rank), len(ranks), [global_ranks[r] for r in ranks])


class GroupRef:
    """A communicator's torch process group, held weakly; calling it gives the group (None: the default one).

    torch's registry owns every group until ``destroy_process_group``, which ``bmt.shutdown()`` calls at exit.
    A wrapped model lives to the end of the script and holds its communicators (tensor parallelism's sub-groups,
    the default group itself when ``tp_size`` = world size): a strong reference there kept the destroyed
    groups, and gloo's threads, alive into interpreter teardown (issue 49).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._ref = None if group is None else weakref.ref(group)

    def __call__(self) -> dist.ProcessGroup | None:
        """The group; raises ``CommError`` once it was destroyed."""
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise CommError("this communicator's process group was destroyed (bmt.shutdown() at exit, or "
                            "torch.distributed.destroy_process_group()): nothing can run on it any more")
        return group
