"""A module made a block in place: ``CheckpointBlock`` and ``bind_block``, which the one-liner
(``apply_plan``) and BMTrain's explicit API (``explicit/block.py``) both stand on.

A block stays the same object: its class is swapped for a generated subclass of both ``CheckpointBlock``
and its own class (as FSDP2's ``fully_shard`` does), so attribute access, ``state_dict`` keys (no extra
infix), ``isinstance`` checks and the forward signature are unchanged, while calls go through the engine.
``block.compile(...)`` compiles the block's own code, never the engine around it (``compiled.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..base.plan import ShardGroupSpec, layout_buffers
from ..errors import WrapError
from ..runtime.active_engine import get_engine
from ..runtime.comm import collective_purpose
from ..runtime.group import ShardGroup
from ..runtime.model_runtime import ModelRuntime
from ..runtime.module_params import Location, ParamSite, check_single_device, param_sites
from ..runtime.param import DistributedParameter
from ..runtime.standalone import full_value
from .compiled import adopt_compile, never_traced
from .consistency import check_same_block
from .sharded_module import ShardedModuleMixin, install_state_hooks

_CLASSES: dict[type, type] = {}
_COUNTER = [0]


class CheckpointBlock(ShardedModuleMixin, nn.Module):
    """Shard ``module``'s parameters as one group and run it through the engine (BMTrain's signature).

    ``CheckpointBlock(module, use_checkpoint=True, zero_level=3, mode="BLOCK")`` returns ``module``
    itself, changed in place. ``zero_level=2`` keeps the gathered parameters from forward to backward.
    ``mode="PIPE"`` marks a block for a ``PipelineTransformerBlockList``, as BMTrain requires. As in
    BMTrain, a list returned by the module comes back as a tuple.
    """

    _bmt_group: ShardGroup
    _bmt_ext: list[list[Location]]
    _bmt_forward: Any  # what the executor runs: the block's own forward, compiled when the user compiled it
    _bmt_eager_forward: Any  # the same, never compiled
    _bmt_mode: str | None = None  # "BLOCK"/"PIPE" when made by this constructor; None when the wrapper bound it

    def __new__(cls, module: nn.Module, use_checkpoint: bool = True, zero_level: int = 3,
                mode: str = "BLOCK") -> CheckpointBlock:
        if cls is not CheckpointBlock:  # the generated subclass is never constructed directly
            raise TypeError(f"{cls.__name__} is created by CheckpointBlock(module)")
        if not isinstance(module, nn.Module):
            raise WrapError(f"CheckpointBlock expects an nn.Module, got {type(module).__name__}")
        if mode not in ("BLOCK", "PIPE"):
            raise WrapError(f"CheckpointBlock(mode={mode!r}): use 'BLOCK' or 'PIPE'")
        _COUNTER[0] += 1
        name = getattr(module, "_bmt_name", None) or f"block{_COUNTER[0]}"
        sites = param_sites(module)
        spec = ShardGroupSpec(name=name, buffers=layout_buffers([s.info() for s in sites]),
                              checkpoint=use_checkpoint, zero_level=zero_level)
        with collective_purpose("block"):
            check_same_block(module, name)
            block = bind_block(module, spec, sites, ext_locations=[])
        block._bmt_mode = mode
        return block

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Python calls __init__ on what __new__ returned: the module is already built and bound.
        pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the original forward through the engine (gather, prefetch, checkpoint, reduce)."""
        out = get_engine().run_block(self._bmt_group, self, self._bmt_forward, args, kwargs, self._bmt_ext)
        # BMTrain's blocks return lists as tuples; blocks the wrapper bound keep the model's own types.
        return tuple(out) if self._bmt_mode is not None and isinstance(out, list) else out

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile the block's own code with ``torch.compile(*args, **kwargs)`` (``nn.Module.compile``'s
        arguments); the engine around it stays eager, and a recompute runs the same compiled code."""
        self._bmt_forward = torch.compile(self._bmt_eager_forward, *args, **kwargs)



def bind_block(module: nn.Module, spec: ShardGroupSpec, sites: list[ParamSite],
               ext_locations: list[list[Location]], sync_from: int | None = 0,
               runtime: ModelRuntime | None = None, compiled_by: nn.Module | None = None) -> CheckpointBlock:
    """Shard ``module``'s parameters per ``spec`` and make ``module`` a ``CheckpointBlock`` in place, in
    ``runtime``'s schedule (default: the explicit API's). ``compiled_by``: the ``torch.compile(module)``
    wrapper the model calls it through, if any."""
    if isinstance(module, CheckpointBlock):
        raise WrapError(f"module {type(module).__name__} ({spec.name!r}) is already a CheckpointBlock; "
                        "wrap each module once")
    device = check_single_device(sites, f"block {spec.name!r}")
    compile_fn = adopt_compile(module, spec.name, compiled_by)  # before any collective: it may raise
    by_name = {n: s for s in sites for n in s.names}
    locations = [[by_name[slot.fqn].locations for slot in b.slots] for b in spec.buffers]
    handed_over = _wrapped_roots_inside(module)
    sources = [[full_value(by_name[slot.fqn].param) for slot in b.slots] for b in spec.buffers]
    adopted = []
    for b in spec.buffers:
        for slot in b.slots:
            p = by_name[slot.fqn].param
            if isinstance(p, DistributedParameter):
                if p.shard_group not in handed_over:
                    _check_not_sharded_elsewhere(p, spec.name, slot.fqn)
                if p.shard_group not in adopted:
                    adopted.append(p.shard_group)
    inits = {slot.fqn: getattr(by_name[slot.fqn].param, "_init_method", None)
             for b in spec.buffers for slot in b.slots}
    engine = get_engine()
    group = engine.build_group(spec, locations, sources, device, sync_from=sync_from, runtime=runtime)
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
    eager = (lambda m, *a, **k: forward(*a, **k)) if forward is not None else original.forward
    module._bmt_eager_forward = eager
    module._bmt_forward = eager if compile_fn is None else compile_fn(eager)
    module._bmt_name = spec.name
    return module  # type: ignore[return-value]


def _wrapped_roots_inside(module: nn.Module) -> list[ShardGroup]:
    """Root groups of models wrapped with ``BMTrainModelWrapper`` inside ``module``, handed over to the block."""
    roots = [m.hand_over_root() for m in module.modules() if isinstance(m, ShardedModuleMixin)]
    return [g for g in roots if g is not None]


def _check_not_sharded_elsewhere(p: nn.Parameter, block: str, fqn: str) -> None:
    if isinstance(p, DistributedParameter) and not p.shard_group.standalone:
        raise WrapError(f"parameter {fqn!r} of block {block!r} already belongs to group "
                        f"{p.shard_group.name!r}: a parameter can live in one block only. Share it "
                        "through the root (a DistributedParameter outside any block) instead.")


def _block_class(cls: type) -> type:
    if cls not in _CLASSES:
        @functools.wraps(cls.forward)
        def forward(self: CheckpointBlock, *args: Any, **kwargs: Any) -> Any:
            return CheckpointBlock.forward(self, *args, **kwargs)

        # The generated forward carries the original's signature (__wrapped__), which transformers
        # inspects to route keyword arguments. Dynamo never traces it: tracing the engine (gathers,
        # autograd nodes, saved-tensor hooks) broke the graph dozens of times per step and made a
        # checkpointed block's recompute differ from its forward (docs/compile.md).
        _CLASSES[cls] = type(f"Block{cls.__name__}", (CheckpointBlock, cls),
                             {"__module__": cls.__module__, "forward": never_traced(forward)})
    return _CLASSES[cls]
