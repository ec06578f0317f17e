"""BMTrain's block lists: ``TransformerBlockList`` and the ``BlockReference`` a module given twice becomes
(``PipelineTransformerBlockList`` is in ``pipeline.py``). The blocks themselves, ``CheckpointBlock`` (``Block``),
are made in place by ``wrapping/bound_block.py``, the binding the wrapper gives each discovered block too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..errors import BlockListError
from ..wrapping.bound_block import CheckpointBlock
from ..wrapping.grad_sync import no_sync
from ..wrapping.sharded_module import install_state_hooks

__all__ = ["Block", "BlockReference", "CheckpointBlock", "TransformerBlockList"]

Block = CheckpointBlock


class TransformerBlockList(nn.Module):
    """A sequence of blocks run one after another (BMTrain's signature): ``(modules, num_hidden=1)``.

    ``forward(*args, return_hidden_states=False)``: the first ``num_hidden`` arguments flow from block to
    block, the rest go to every block unchanged. Modules that are not blocks yet become
    ``CheckpointBlock``s. With ``return_hidden_states`` the result also holds each flowing input of
    every block, stacked along a new first dimension.

    As in BMTrain, one plain module given twice is one block run twice (its second entry is a
    ``BlockReference`` sharing its parameters), and one ``Block`` given twice raises ``BlockListError``.
    """

    _block_mode = "BLOCK"

    def __init__(self, modules: list[nn.Module] | nn.ModuleList, num_hidden: int = 1) -> None:
        super().__init__()
        made: dict[int, CheckpointBlock] = {}  # plain modules this list turned into blocks
        given: set[int] = set()  # blocks passed in already made
        for i, m in enumerate(modules):
            if id(m) in made:
                entry: nn.Module = BlockReference(made[id(m)])
            elif isinstance(m, CheckpointBlock):
                if id(m) in given:
                    raise BlockListError(f"block {m._bmt_name!r} is given twice to one {type(self).__name__} "
                                         "(BMTrain: duplicate Block not supported); pass the plain module "
                                         "twice to run one block twice, or make two blocks")
                if self._block_mode == "PIPE" and m._bmt_mode != "PIPE":
                    raise BlockListError(f"block {m._bmt_name!r} was not made for a pipeline: as in BMTrain, "
                                         "create it with bmt.Block(module, mode='PIPE'), or pass the plain "
                                         "module")
                given.add(id(m))
                entry = m
            else:
                entry = made[id(m)] = CheckpointBlock(m, mode=self._block_mode)
            self.add_module(str(i), entry)
        self.num_hidden = num_hidden

    def __len__(self) -> int:
        return len(self._modules)

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside reduce none of the blocks' gradients; the first one outside reduces them all."""
        return no_sync(self)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int | str) -> nn.Module:
        return self._modules[str(index) if isinstance(index, str) else str(range(len(self))[index])]

    def forward(self, *args: Any, return_hidden_states: bool = False, **kwargs: Any) -> Any:
        """Run every block in order."""
        hidden: list[torch.Tensor] = []
        outputs: tuple = tuple(args[:self.num_hidden])
        for block in self:
            if return_hidden_states:
                hidden.extend(args[:self.num_hidden])
            out = block(*args, **kwargs)
            outputs = out if isinstance(out, tuple) else (out,)
            args = outputs + tuple(args[self.num_hidden:])
        if return_hidden_states:
            stacked = tuple(torch.stack(hidden[i::self.num_hidden], dim=0) for i in range(self.num_hidden))
            return tuple(outputs) + stacked
        return tuple(outputs[:self.num_hidden]) if self.num_hidden > 1 else outputs[0]


class BlockReference(nn.Module):
    """A second entry of a block list for a block already in it: calls run that block again.

    It shares the block's parameter, buffer and child registries, so ``state_dict`` lists the shared
    tensors under both entries' names (as BMTrain's referencing blocks do) while ``parameters()`` yields
    them once, and both names load the same parameters.
    """

    def __init__(self, block: CheckpointBlock) -> None:
        super().__init__()
        self._parameters = block._parameters
        self._buffers = block._buffers
        self._modules = block._modules
        object.__setattr__(self, "block", block)  # not a child: its tensors are already ours
        for buf_locs in block._bmt_group.locations:
            for slot_locs in buf_locs:
                slot_locs.extend([(self, attr) for m, attr in list(slot_locs) if m is block])
        install_state_hooks(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the referenced block."""
        return self.block(*args, **kwargs)
