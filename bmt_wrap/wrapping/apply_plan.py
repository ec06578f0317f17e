"""Apply a ``WrapPlan`` to a model in place: shard every group, bind blocks, hook the root forward.

This is where the plan (from ``passes/`` or a JSON file) meets the engine (``runtime/``); it knows the
module tree but nothing of how the plan was made.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..base._compat import pytree
from ..base.dtypes import to_dtype
from ..base.mixed_precision import MixedPrecision
from ..base.plan import WrapPlan
from ..errors import PlanError, WrapError
from ..loss.product_head import HeadWeight
from ..optim import clip_grad_norm_, install_grad_scaler_guard
from ..runtime.active_engine import get_engine
from ..runtime.comm import ParallelLayout
from ..runtime.engine import Engine, storage_mode
from ..runtime.gather_function import regathered
from ..runtime.group import ShardGroup
from ..runtime.model_runtime import ModelRuntime
from ..runtime.module_params import Location, ParamSite, check_single_device, param_sites
from ..runtime.standalone import full_value
from .bound_block import CheckpointBlock, bind_block
from .compiled import compiled_wrapper, never_traced
from .offload_option import offload_store
from .one_backward import refuse_second_backward
from .pipeline import Stages, place_root, root_specs, sync_from_rank0
from .sharded_module import ShardedModuleMixin, install_state_hooks

_ROOT_CLASSES: dict[type, type] = {}


class WrappedModule(ShardedModuleMixin, nn.Module):
    """Mixed into a wrapped model's class: sharded state_dict, guarded ``.to()``, and ``.plan``."""

    plan: WrapPlan
    _bmt_root: ShardGroup | None
    _bmt_mp: MixedPrecision | None
    _bmt_runtime: ModelRuntime  # this model's groups and schedule

    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
        """Clip to the norm of the full gradient over every rank, as FSDP's ``clip_grad_norm_`` does (tools that
        clip with ``torch.nn.utils.clip_grad_norm_`` clip each rank's shard alone: see docs/integrations.md)."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def hand_over_root(self) -> ShardGroup | None:
        """A ``CheckpointBlock`` around this model takes its parameters: stop its root hooks, return its root group.

        BMTrain code wraps small layers with ``BMTrainModelWrapper`` and puts their parent in a block; the
        block then gathers and reduces those parameters with its own, so the layer is no model root any more.
        """
        if any(not g.is_root for g in self.plan.groups) or self._bmt_mp is not None:
            raise WrapError(f"a CheckpointBlock cannot take over the wrapped {type(self).__name__}: it has blocks "
                            "or mixed precision of its own. Put the block around the plain module and wrap the "
                            "whole model once, or wrap only the parts outside the block.")
        for hooks, fn in ((self._forward_pre_hooks, never_traced(_root_pre_hook)),
                          (self._forward_hooks, never_traced(_root_post_hook))):
            for key in [k for k, h in hooks.items() if h is fn]:
                del hooks[key]
                self._forward_pre_hooks_with_kwargs.pop(key, None)
                self._forward_hooks_always_called.pop(key, None)
        root, self._bmt_root = self._bmt_root, None
        return root


def is_wrapped(model: nn.Module) -> bool:
    """True if ``model`` was already wrapped."""
    return isinstance(model, WrappedModule)


def apply_plan(model: nn.Module, plan: WrapPlan, mixed_precision: MixedPrecision | None = None, *,
               layout: ParallelLayout | None = None, offload: str | None = None,
               offload_dir: str | os.PathLike[str] | None = None, stages: Stages | None = None) -> nn.Module:
    """Shard ``model`` per ``plan`` in place (over ``layout``'s dp group, with its TP group for TP-split
    parameters; default: the layout the engine holds) and return it; ``offload``: keep each rank's shards in a file under ``offload_dir`` (``"disk"``) or in host memory
    (``"host"``); ``stages``: under pipeline parallelism, this rank builds its stage's groups and ghosts of
    the others' (``wrapping/pipeline.py``)."""
    if is_wrapped(model) or isinstance(model, CheckpointBlock):
        raise WrapError(f"{type(model).__name__} is already wrapped; wrap a model once "
                        "(BMTrainModelWrapper returns the same object, changed in place)")
    plan.validate()
    if plan.resident:
        raise PlanError(f"the plan keeps {len(plan.resident)} parameter(s) resident (unsharded), which this "
                        f"version cannot execute yet: {plan.resident[:3]}. Empty plan.resident to shard them.")
    sites = param_sites(model)
    device = check_single_device(sites, type(model).__name__)
    _check_plan_covers(model, plan, sites)
    _check_plan_precision(plan, mixed_precision)
    by_name = {n: s for s in sites for n in s.names}
    del sites  # by_name alone holds the originals now, and lets each go once its group holds its shard
    engine = get_engine()
    if layout is not None:
        engine.adopt_layout(layout)
    runtime = engine.new_runtime(type(model).__name__)
    runtime.offload = offload_store(engine.comm, offload, offload_dir, engine.device)
    root_params = {id(by_name[slot.fqn].param) for g in plan.groups if g.is_root for _, slot in g.slots()}

    # Which root parameters each block uses is read off the original module tree, before any group
    # replaces parameters with shards.
    blocks = {spec.name: _submodule(model, spec.name) for spec in plan.groups if not spec.is_root}
    ext = {name: [[loc for loc in by_name[n].locations if _inside(loc, module)]
                  for n in _ext_names(module, root_params, by_name)] for name, module in blocks.items()}
    root_group: ShardGroup | None = None
    sync_from: int | None = 0
    if stages is not None:
        sync_from_rank0(plan.groups, by_name, stages.layout.tp_rank, stages.layout.tp_size)  # then each stage keeps its own
        sync_from = None
    for spec in plan.groups:
        if spec.is_root and stages is not None:
            root_group = _build_stage_root(engine, runtime, spec, by_name, device, stages)
        elif spec.is_root:
            root_group = _build_root(engine, runtime, spec, by_name, device)
        elif stages is not None and stages.owner(spec.name) != stages.mine:
            placement = stages.placement((stages.owner(spec.name),))
            blocks[spec.name]._bmt_group = _hook_states(engine.ghost_group(spec, _locations(spec, by_name),
                                                                           placement, device, runtime))
        else:
            block = bind_block(blocks[spec.name], spec, _group_sites(spec, by_name), ext_locations=ext[spec.name],
                               sync_from=sync_from, runtime=runtime, compiled_by=compiled_wrapper(model, spec.name))
            if stages is not None:
                engine.place_on_stage(block._bmt_group, stages.placement((stages.mine,)))
        _release(spec, by_name)
    engine.sync_buffers(model, 0)
    _turn_off_self_checkpointing(model, plan)
    _install_schedule(runtime, plan, {name: module._bmt_group for name, module in blocks.items()})

    model.__class__ = _root_class(type(model))
    model.plan = plan
    model._bmt_root = root_group
    model._bmt_runtime = runtime
    model._bmt_mp = mixed_precision
    # Dynamo never traces the hooks (gathers, the first forward's capture): see compiled.py.
    model.register_forward_pre_hook(never_traced(_root_pre_hook), with_kwargs=True)
    model.register_forward_hook(never_traced(_root_post_hook), always_call=True)
    if engine.world_size > 1:
        install_grad_scaler_guard()  # GradScaler would check inf/nan on this rank's slice only
    return model


def update_schedule(model: WrappedModule, plan: WrapPlan) -> None:
    """Adopt ``plan``'s schedule (order, prefetch depth, checkpoint and ZeRO level per block).

    The layout must be the one already applied: groups, parameters and offsets never change after
    wrapping (docs/design.md, contracts).
    """
    old = model.plan
    if [(g.name, g.buffers) for g in old.groups] != [(g.name, g.buffers) for g in plan.groups]:
        raise PlanError("a new schedule may not change the layout fixed at wrap time (groups, parameters, "
                        "offsets); pass the layout-changing plan to BMTrainModelWrapper(model, plan=...) instead")
    groups: dict[str, ShardGroup] = {}
    for spec in plan.blocks():
        group = model.get_submodule(spec.name)._bmt_group
        if group.gathered and storage_mode(spec) != group.mode:
            raise PlanError(f"cannot change how block {spec.name!r} is checkpointed while its parameters "
                            "are gathered")
        group.spec = spec
        group.mode = storage_mode(spec)
        groups[spec.name] = group
    _install_schedule(model._bmt_runtime, plan, groups)
    model.plan = plan


# ---- building ---------------------------------------------------------------------------------------------
def _group_sites(spec: Any, by_name: dict[str, ParamSite]) -> list[ParamSite]:
    """The sites of ``spec``'s parameters, each once."""
    return list({id(site): site for site in (by_name[slot.fqn] for _, slot in spec.slots())}.values())


def _release(spec: Any, by_name: dict[str, ParamSite]) -> None:
    """Forget the original parameters of a group just sharded, so each goes as soon as its group holds
    its shard: wrapping then peaks at the model as built plus about one group, not plus every shard
    (all originals kept to the end held a 21-layer GPT of width 1024 plus its 537 MiB of shards)."""
    for site in _group_sites(spec, by_name):
        for name in site.names:
            by_name.pop(name, None)


def _check_plan_covers(model: nn.Module, plan: WrapPlan, sites: list[ParamSite]) -> None:
    placed = set(plan.all_fqns())
    canonical = {s.names[0] for s in sites}
    names = {n for s in sites for n in s.names}
    missing = sorted(canonical - placed)
    unknown = sorted(n for n in placed if n not in names)
    if missing or unknown:
        raise PlanError(f"the plan does not match {type(model).__name__}: parameters not in the plan "
                        f"{missing[:5]}, plan entries not in the model {unknown[:5]}. Regenerate the plan "
                        "for this model (bmt-wrap dump --format json) or wrap without plan=.")


def _check_plan_precision(plan: WrapPlan, mp: MixedPrecision | None) -> None:
    """The plan's buffer dtypes (shard, gathered, reduced) are what the runtime executes: they must be
    the ones ``mp`` implies, else inputs would be cast for parameters gathered in another dtype."""
    for g in plan.groups:
        for b in g.buffers:
            want = mp.buffer_dtypes(b.dtype) if mp is not None else (b.dtype, None, None)
            if (b.dtype, b.param_dtype, b.reduce_dtype) != want:
                raise PlanError(
                    f"group {g.name!r}: the plan stores {b.dtype} shards gathered in {b.gather_dtype} and "
                    f"reduced in {b.grad_dtype}, which is not what mixed_precision={mp} implies. Pass the "
                    "mixed_precision= the plan was made with, or rebuild the plan with this one "
                    "(wrap without plan=).")


def _install_schedule(runtime: ModelRuntime, plan: WrapPlan, groups: dict[str, ShardGroup]) -> None:
    """The plan's block order and prefetch depth become what ``runtime`` executes (this stage's blocks)."""
    runtime.set_schedule([groups[n] for n in plan.order if n in groups and not groups[n].ghost],
                         plan.prefetch_depth)


def _turn_off_self_checkpointing(model: nn.Module, plan: WrapPlan) -> None:
    """The plan's checkpointing recomputes these modules' layers: their own would run them a third time."""
    for name in plan.self_checkpointing_off:
        try:
            model.get_submodule(name).gradient_checkpointing = False
        except AttributeError:
            raise PlanError(f"the plan turns off gradient checkpointing of module {name!r}, which "
                            f"{type(model).__name__} does not have; regenerate the plan for this "
                            "model") from None


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanError(f"the plan names block {name!r}, which {type(model).__name__} does not have") from None


def _inside(loc: Location, block: nn.Module) -> bool:
    return any(m is loc[0] for m in block.modules())


def _ext_names(block: nn.Module, root_params: set[int], by_name: dict[str, ParamSite]) -> list[str]:
    """Canonical names of root-group parameters that ``block`` uses (shared with other blocks)."""
    by_id = {id(s.param): s for s in by_name.values()}
    return [by_id[id(p)].names[0] for p in block.parameters() if id(p) in root_params]


def _locations(spec: Any, by_name: dict[str, ParamSite]) -> list[list[list[Location]]]:
    return [[by_name[slot.fqn].locations for slot in b.slots] for b in spec.buffers]


def _hook_states(group: ShardGroup) -> ShardGroup:
    """Modules holding ``group``'s parameters read them whole in ``state_dict()`` (a ghost: from its stage)."""
    for locs in group.locations:
        for slot_locs in locs:
            for m, _ in slot_locs:
                install_state_hooks(m)
    return group


def _build_stage_root(engine: Engine, runtime: ModelRuntime, spec: Any, by_name: dict[str, ParamSite],
                      device: torch.device, stages: Stages) -> ShardGroup | None:
    """This stage's root group, and ghosts of the root parameters only other stages hold."""
    own, ghosts = root_specs(spec, stages)
    for placement, sub in ghosts:
        _hook_states(engine.ghost_group(sub, _locations(sub, by_name), placement, device, runtime))
    if own is None:
        return None
    group = _build_root(engine, runtime, own, by_name, device, sync_from=None)
    place_root(group, stages)
    return group


def _build_root(engine: Engine, runtime: ModelRuntime, spec: Any, by_name: dict[str, ParamSite],
                device: torch.device, sync_from: int | None = 0) -> ShardGroup:
    locations = _locations(spec, by_name)
    sources = [[full_value(by_name[slot.fqn].param).to(to_dtype(b.dtype)) for slot in b.slots]
               for b in spec.buffers]
    group = engine.build_group(spec, locations, sources, device, sync_from=sync_from, runtime=runtime)
    for locs in locations:
        for slot_locs in locs:
            for m, _ in slot_locs:
                install_state_hooks(m)
    trainable = [i for i, b in enumerate(spec.buffers) if b.requires_grad]
    for i in trainable if len(trainable) > 1 else []:
        if len(locations[i]) == 1 and len(locations[i][0]) == 1:
            module, attr = locations[i][0][0]
            module.register_forward_pre_hook(never_traced(_regather_hook(engine, group, i, attr)))
    return group


def _regather_hook(engine: Engine, group: ShardGroup, index: int, attr: str) -> Any:
    """A forward pre-hook on the module of a root buffer's single parameter (a vocabulary head laid out alone):
    its gathered tensor gets an autograd node of its own at the module's call, so its gradient is
    reduce-scattered as soon as the module's backward ends, not after the blocks' (runtime/gather_function.py)."""
    def hook(module: nn.Module, args: tuple) -> None:
        installed = module._parameters.get(attr)
        marked = installed if isinstance(installed, HeadWeight) else None  # a fused product head's weight
        late = regathered(engine, group, index, marked.value() if marked is not None else installed) \
            if installed is not None else None
        if late is not None:  # the root's post-hook puts the shard back after the forward
            module._parameters[attr] = HeadWeight.of(late, marked._kind) if marked is not None else late
    return hook


def _root_class(cls: type) -> type:
    if cls not in _ROOT_CLASSES:
        _ROOT_CLASSES[cls] = type(f"Wrapped{cls.__name__}", (WrappedModule, cls), {"__module__": cls.__module__})
    return _ROOT_CLASSES[cls]


# ---- the root's forward ----------------------------------------------------------------------------------
def _root_pre_hook(model: WrappedModule, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    engine = get_engine()
    first = getattr(model, "_bmt_first_forward", None)
    if first is not None:
        model._bmt_outermost = None  # until the capture succeeds: a failure there began no forward
        first.before(model, args, kwargs)
    model._bmt_outermost = not engine.in_forward
    root = model._bmt_root
    if model._bmt_outermost:
        engine.begin_forward(model._bmt_runtime, lead=root)
    if root is not None:
        root.install(engine.gather_for_root(root))
    mp = model._bmt_mp
    if mp is not None and mp.cast_forward_inputs:
        return pytree.tree_map(mp.cast_input, args), pytree.tree_map(mp.cast_input, kwargs)
    return None


def _root_post_hook(model: WrappedModule, args: tuple, output: Any) -> Any:
    engine = get_engine()
    if getattr(model, "_bmt_outermost", True) is None:
        return None  # the first forward's capture raised (a memory budget it cannot meet): retried next call
    if model._bmt_root is not None:
        model._bmt_root.restore()
    if getattr(model, "_bmt_outermost", True):
        engine.end_forward(model._bmt_runtime)
    first = getattr(model, "_bmt_first_forward", None)
    if first is not None:
        model._bmt_first_forward = None
        first.after(model)  # which also collects the capture's reference cycles
    mp = model._bmt_mp
    cast = mp is not None and mp.output_dtype is not None
    result = pytree.tree_map(mp.cast_output, output) if cast else output
    if getattr(model, "_bmt_outermost", True):
        refuse_second_backward(type(model).__bases__[-1].__name__, result)  # the user's class (_root_class)
    return result if cast else None
