"""BMTrain's ``bmtrain.block_layer`` module path for the block classes."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from ..explicit.block import Block, CheckpointBlock, TransformerBlockList

__all__ = ["Block", "CheckpointBlock", "CheckpointBlockContext", "TransformerBlockList"]


class CheckpointBlockContext:
    """BMTrain's internal gather/release context of a block; importable, but bmt_wrap's engine does that."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("CheckpointBlockContext is BMTrain's internal gather context; bmt_wrap gathers "
                               "inside the block's call. For full parameters outside forward use "
                               "`with bmt.gathered(model):`")
