"""Blocks: ``CheckpointBlock`` (BMTrain's explicit API) and the in-place binding the wrapper also uses.

A block stays the same object: its class is swapped for a generated subclass of both ``CheckpointBlock``
and its own class (as FSDP2's ``fully_shard`` does), so attribute access, ``state_dict`` keys (no extra
infix), ``isinstance`` checks and the forward signature are unchanged, while calls go through the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .errors import WrapError
from .plan import ShardGroupSpec, layout_buffers
from .runtime.engine import get_engine
from .runtime.group import Location, ShardGroup
from .runtime.module_params import ParamSite, check_single_device, param_sites
from .runtime.param import DistributedParameter
from .runtime.standalone import full_value
from .sharded_module import ShardedModuleMixin, install_state_hooks

_CLASSES: dict[type, type] = {}
_COUNTER = [0]


class CheckpointBlock(ShardedModuleMixin, nn.Module):
    """Shard ``module``'s parameters as one group and run it through the engine (BMTrain's signature).

    ``CheckpointBlock(module, use_checkpoint=True, zero_level=3)`` returns ``module`` itself, changed in
    place. ``zero_level=2`` keeps the gathered parameters from forward to backward.
    """

    _bmt_group: ShardGroup
    _bmt_ext: list[list[Location]]
    _bmt_forward: Any

    def __new__(cls, module: nn.Module, use_checkpoint: bool = True, zero_level: int = 3) -> CheckpointBlock:
        if cls is not CheckpointBlock:  # the generated subclass is never constructed directly
            raise TypeError(f"{cls.__name__} is created by CheckpointBlock(module)")
        if not isinstance(module, nn.Module):
            raise WrapError(f"CheckpointBlock expects an nn.Module, got {type(module).__name__}")
        _COUNTER[0] += 1
        name = getattr(module, "_bmt_name", None) or f"block{_COUNTER[0]}"
        sites = param_sites(module)
        spec = ShardGroupSpec(name=name, buffers=layout_buffers([s.info() for s in sites]),
                              checkpoint=use_checkpoint, zero_level=zero_level)
        return bind_block(module, spec, sites, ext_locations=[])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Python calls __init__ on what __new__ returned: the module is already built and bound.
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the original forward through the engine (gather, prefetch, checkpoint, reduce)."""
        return get_engine().run_block(self._bmt_group, self, self._bmt_forward, args, kwargs, self._bmt_ext)


Block = CheckpointBlock


def bind_block(module: nn.Module, spec: ShardGroupSpec, sites: list[ParamSite],
               ext_locations: list[list[Location]], sync_from: int | None = 0) -> CheckpointBlock:
    """Shard ``module``'s parameters per ``spec`` and make ``module`` a ``CheckpointBlock`` in place."""
    if isinstance(module, CheckpointBlock):
        raise WrapError(f"module {type(module).__name__} ({spec.name!r}) is already a CheckpointBlock; "
                        "wrap each module once")
    device = check_single_device(sites, f"block {spec.name!r}")
    by_name = {n: s for s in sites for n in s.names}
    locations = [[by_name[slot.fqn].locations for slot in b.slots] for b in spec.buffers]
    sources = [[full_value(by_name[slot.fqn].param) for slot in b.slots] for b in spec.buffers]
    adopted = []
    for b in spec.buffers:
        for slot in b.slots:
            p = by_name[slot.fqn].param
            _check_not_sharded_elsewhere(p, spec.name, slot.fqn)
            if isinstance(p, DistributedParameter):
                adopted.append(p._bmt_buffer.group)
    inits = {slot.fqn: getattr(by_name[slot.fqn].param, "_init_method", None)
             for b in spec.buffers for slot in b.slots}
    engine = get_engine()
    group = engine.build_group(spec, locations, sources, device, sync_from=sync_from)
    for old in adopted:
        engine.forget(old)
    for locs in locations:
        for slot_locs in locs:
            for m, _ in slot_locs:
                install_state_hooks(m)
    for buf in group.buffers:
        for slot, p in zip(buf.spec.slots, buf.params, strict=True):
            p._init_method = inits[slot.fqn]
    engine.sync_buffers(module, sync_from)
    forward = module.__dict__.pop("forward", None)
    original = type(module)
    module.__class__ = _block_class(original)
    module._bmt_group = group
    module._bmt_ext = ext_locations
    module._bmt_forward = (lambda m, *a, **k: forward(*a, **k)) if forward is not None else original.forward
    module._bmt_name = spec.name
    return module  # type: ignore[return-value]


def _check_not_sharded_elsewhere(p: nn.Parameter, block: str, fqn: str) -> None:
    if isinstance(p, DistributedParameter) and not p._bmt_buffer.group.standalone:
        raise WrapError(f"parameter {fqn!r} of block {block!r} already belongs to group "
                        f"{p._bmt_buffer.group.name!r}: a parameter can live in one block only. Share it "
                        "through the root (a DistributedParameter outside any block) instead.")


def _block_class(cls: type) -> type:
    if cls not in _CLASSES:
        @functools.wraps(cls.forward)
        def forward(self: CheckpointBlock, *args: Any, **kwargs: Any) -> Any:
            return CheckpointBlock.forward(self, *args, **kwargs)

        # The generated forward carries the original's signature (__wrapped__), which transformers
        # inspects to route keyword arguments.
        _CLASSES[cls] = type(f"Block{cls.__name__}", (CheckpointBlock, cls),
                             {"__module__": cls.__module__, "forward": forward})
    return _CLASSES[cls]


class TransformerBlockList(nn.Module):
    """A sequence of blocks run one after another (BMTrain's signature): ``(modules, num_hidden=1)``.

    ``forward(*args, return_hidden_states=False)``: the first ``num_hidden`` arguments flow from block to
    block, the rest go to every block unchanged. Modules that are not blocks yet become
    ``CheckpointBlock``s. With ``return_hidden_states`` the result also holds each flowing input of
    every block, stacked along a new first dimension.
    """

    def __init__(self, modules: list[nn.Module] | nn.ModuleList, num_hidden: int = 1) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m if isinstance(m, CheckpointBlock) else CheckpointBlock(m))
        self.num_hidden = num_hidden

    def __len__(self) -> int:
        return len(self._modules)

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
