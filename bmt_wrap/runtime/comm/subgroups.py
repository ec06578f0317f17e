"""Sub-groups of backends that run on torch process groups (gloo, torch's NCCL): the checks they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
