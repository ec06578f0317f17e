"""Apply a plan's pipeline section in place (docs/design.md, "Pipeline parallelism in the one-liner").

Every rank keeps the whole module tree and runs the model's own forward. What belongs to another stage
is a ghost there: its parameters are empty ranges (``Engine.ghost_group``), and a module holding them
computes only its output's structure and shapes on the meta skeleton and returns placeholders, so the
root's own code (masks, positions) still runs for real on every stage. The block just before a stage
returns the activations the previous stage sent; after a stage's last block its output goes to the next
stage and the rest of that forward is skipped. The wrapper's forward cuts the batch into micro-batches and
runs the model's forward once per micro-batch (GPipe); the last stage's loss is the whole batch's, and
every stage returns it (``runtime/pipeline.py``).

With V stages per rank (``pp_virtual_stages``), rank r runs stages r, r + P, ...: several runs of blocks,
each received from the rank before and sent to the rank after. One call of the model's forward runs all of
them in turn (the loop), or, under a torch schedule, one of them (``_Run.active``), this rank's other runs'
blocks then being ghosts too.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base._compat import pytree
from ..base.pipeline_plan import PipelinePlan
from ..base.plan import ROOT, ShardGroupSpec, WrapPlan
from ..errors import PipelineError, PlanError
from ..job.distributed import agree, get_state
from ..job.tp_inputs import _digest, raise_if_stages_differ
from ..loss.lazy_logits import LazyLogits
from ..passes.capture import to_meta
from ..passes.pipeline import check_virtual, stage_root_spec
from ..runtime.active_engine import get_engine
from ..runtime.comm import Communicator, ParallelLayout, StagePlacement
from ..runtime.flat_buffer import GhostBuffer
from ..runtime.group import ShardGroup
from ..runtime.module_params import Location, ParamSite, installed, registrations
from ..runtime.param import DistributedParameter
from ..runtime.pipeline import (
    Ends,
    Hop,
    RecvActivations,
    SendActivations,
    ShareOutput,
    anchor,
    drain,
    forward_tag,
    send_failure,
)
from ..runtime.tp_marks import tp_split_dim
from .compiled import never_traced


@dataclass
class Stages:
    """This rank's view of the pipeline while wrapping: its stage, the pipe group, the section."""

    section: PipelinePlan
    layout: ParallelLayout

    @property
    def mine(self) -> int:
        """This rank in the pipe group."""
        return self.layout.pp_rank

    @property
    def pp(self) -> Communicator:
        """The pipe group."""
        assert self.layout.pp is not None
        return self.layout.pp

    def owner(self, block: str) -> int:
        """The pipe-group rank that holds ``block``."""
        return self.section.rank_of_block(block)

    def placement(self, ranks: tuple[int, ...]) -> StagePlacement:
        """Where a buffer of parameters ``ranks`` hold lives (the first of them answers for its values)."""
        return StagePlacement(self.pp, ranks[0], ranks)


def sync_from_rank0(specs: list[ShardGroupSpec], by_name: dict[str, ParamSite], tp_rank: int = 0,
                    tp_size: int = 1) -> None:
    """Give every rank rank 0's values of ``specs``' parameters, one broadcast per flat buffer over the job
    (as ZeRO-3's wrapping does), before each stage keeps only its own: the stages then start from one
    model wherever it was built. Under TP, a buffer holding TP-split slices is broadcast from each of the
    first TP group's ranks in turn (rank t = tp_rank t of stage 0), each rank keeping its own TP rank's."""
    comm = get_engine().comm
    if comm.world_size == 1:
        return
    for spec in specs:
        for b in spec.buffers:
            params = [by_name[s.fqn].param for s in b.slots]
            if any(p.is_meta for p in params):
                continue
            split = tp_size > 1 and any(tp_split_dim(p) is not None for p in params)
            flat = torch.zeros(b.numel, dtype=params[0].dtype, device=params[0].device)
            with torch.no_grad():
                for src in range(tp_size if split else 1):
                    if src == tp_rank or not split:
                        for s, p in zip(b.slots, params, strict=True):
                            flat[s.offset:s.offset + s.numel].copy_(p.detach().reshape(-1))
                    comm.broadcast(flat, src, label=f"{spec.name} parameters (pipeline)")
                    if src == tp_rank or not split:
                        for s, p in zip(b.slots, params, strict=True):
                            p.detach().copy_(flat[s.offset:s.offset + s.numel].view(p.shape))


def root_specs(root: ShardGroupSpec, stages: Stages) -> tuple[ShardGroupSpec | None, list[tuple[StagePlacement,
                                                                                               ShardGroupSpec]]]:
    """This stage's root group (its own root parameters, and in a buffer of their own those it shares with
    another stage), and the other stages' root parameters it holds ghosts of, by placement."""
    mine: list[tuple[tuple[int, ...], list[str]]] = []
    ghosts: list[tuple[StagePlacement, ShardGroupSpec]] = []
    for holders, names in stages.section.root_sets():
        if stages.mine in holders:
            mine.append((holders, names))
        else:
            ghosts.append((stages.placement(holders), stage_root_spec(root, names)))
    if not mine:
        return None, ghosts
    # Each set in buffers of its own: a shared set's buffer is laid out alike on both stages.
    buffers = [b for _, names in mine for b in stage_root_spec(root, names).buffers]
    return ShardGroupSpec(ROOT, buffers, root.checkpoint, root.zero_level), ghosts


def place_root(group: ShardGroup, stages: Stages) -> None:
    """Mark each buffer of this stage's root group with the stages holding its parameters."""
    holders = {name: h for h, names in stages.section.root_sets() for name in names}
    for b in group.buffers:
        get_engine().place_buffer(b, stages.placement(holders[b.spec.slots[0].fqn]))


# ---- ghosts -------------------------------------------------------------------------------------------------
class _StageDone(Exception):
    """Raised after a non-last stage sent its last block's output: the rest of that forward belongs to
    later stages. Caught by the pipeline's forward."""


@dataclass
class _Run:
    """One pipelined forward in progress on this rank."""

    micro: int = 0
    tokens: list[torch.Tensor] = field(default_factory=list)
    received: set[int] = field(default_factory=set)  # transfers (``transfer_index``) that arrived (or failed)
    sent: set[int] = field(default_factory=set)  # transfers that went to the next stage
    active: int | None = None  # the one stage of this rank a torch schedule runs now (None: all of them)
    # Under a torch schedule (pipeline_schedule.py): what its receive got for this micro-batch, and where
    # this stage's last block's output goes for its send (None: this module moves them itself).
    given: tuple[torch.Tensor, ...] | None = None
    taken: list[torch.Tensor] | None = None


class PipelineRuntime:
    """What a pipelined model keeps: the section, its stage, the pipe group, the meta skeleton ghosts run on."""

    def __init__(self, model: nn.Module, section: PipelinePlan, layout: ParallelLayout, skeleton: nn.Module) -> None:
        self.section, self.layout, self.skeleton = section, layout, skeleton
        assert layout.pp is not None
        self.ends = Ends(layout.pp, f"pipeline of {type(model).__name__}")
        self.stage = layout.pp_rank  # this rank in the pipe group
        self.mine = section.stages_on(self.stage)  # the stages it runs, in order
        self.count = len(section.stages)
        self.run: _Run | None = None
        self.ghost_params: list[tuple[nn.Module, str, torch.Size, torch.dtype]] = []
        self.held: list[ShardGroup] = []  # this stage's blocks, gathered for the step in progress
        self.structures: dict[Any, Any] = {}  # ghosts' meta outputs by call (``_meta_output``)
        self.accepts_items = False  # the model's own forward takes num_items_in_batch
        self.scheduled: Any = None  # the torch schedule model.pipeline_step last ran (pipeline_schedule.py)

    def __deepcopy__(self, memo: dict[int, Any]) -> PipelineRuntime:
        return self  # a communicator is not copied with the model (meta skeletons, reference copies)

    @property
    def last_stage(self) -> bool:
        """True on the rank that runs the last stage (the loss)."""
        return self.count - 1 in self.mine

    def boundary(self, stage: int) -> str:
        """The block whose output stage ``stage`` (> 0) receives: the previous stage's last."""
        return self.section.stages[stage - 1].blocks[-1]

    def transfer_index(self, micro: int, sender: int) -> int:
        """Which transfer of a step carries micro-batch ``micro``'s activations from stage ``sender`` to the
        next (the tag between two ranks: with V stages per rank, one pair carries several per micro-batch)."""
        return micro * self.count + sender


def install_ghosts(model: nn.Module, runtime: PipelineRuntime, ghost_blocks: list[str],
                   ghost_locations: list[Location]) -> None:
    """Give the modules of other ranks' stages their ghost forwards, the block before each of this rank's stages
    the receive, and each one's last block the send."""
    modules = dict(model.named_modules())
    receives = {runtime.boundary(s): s for s in runtime.mine if s > 0}
    for name in ghost_blocks:
        if name in receives:
            _set_forward(modules[name], _receive_forward(runtime, name, receives[name]))
        else:
            _set_forward(modules[name], _ghost_forward(runtime, name))
    if len(runtime.mine) > 1:  # a torch schedule runs one of them per call: the others' blocks are ghosts then
        for s in runtime.mine:
            for name in runtime.section.stages[s].blocks:
                modules[name].forward = _own_forward(runtime, name, s, modules[name].forward)
    # Root modules all of whose parameters live on other stages compute nothing either.
    ghost_ids = {id(m) for m, _ in ghost_locations}
    blocks = {b for s in runtime.section.stages for b in s.blocks}
    for name, module in modules.items():
        inside = name in blocks or any(name.startswith(b + ".") for b in blocks) or \
            any(b.startswith(name + ".") or name == "" for b in blocks)
        own = [p for p in module._parameters.values() if p is not None]
        if not inside and own and id(module) in ghost_ids:
            _set_forward(module, _ghost_forward(runtime, name))
    # Parameters the root's own code reads directly (a position table) get zero placeholders while a
    # forward runs on a stage that does not hold them.
    runtime.ghost_params = [(m, attr, m._parameters[attr].shape, m._parameters[attr].dtype)
                            for m, attr in ghost_locations if not _has_ghost_forward(m)]
    for s in runtime.mine:
        if s < runtime.count - 1:
            last = runtime.section.stages[s].blocks[-1]
            modules[last].register_forward_hook(never_traced(_send_hook(runtime, s)))


def _set_forward(module: nn.Module, forward: Any) -> None:
    module.forward = forward
    module._bmt_ghost = True


def _has_ghost_forward(module: nn.Module) -> bool:
    return getattr(module, "_bmt_ghost", False)


def _placeholder(x: Any, device: torch.device) -> Any:
    return torch.zeros(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x


def _meta_output(runtime: PipelineRuntime, name: str, args: tuple, kwargs: dict) -> Any:
    """What module ``name``'s forward returns for these arguments, run on the meta skeleton once per kind
    of call: the same arguments' shapes, dtypes and plain values give the same structure (a meta run costs
    a block's Python, once per micro-batch and ghost otherwise)."""
    key = (name, _call_key((args, kwargs)))
    cached = runtime.structures.get(key)
    if cached is not None:
        return cached
    module = runtime.skeleton.get_submodule(name)
    try:
        with torch.no_grad():
            out = module(*to_meta(args), **to_meta(kwargs))
    except Exception as exc:
        raise PipelineError(f"{name!r} belongs to another pipeline stage, and its output's shape could not be "
                            f"computed on the meta device ({type(exc).__name__}: {exc}); a stage needs every "
                            "earlier module's output structure to run the model's own code") from exc
    if all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in pytree.tree_leaves(out)):
        runtime.structures[key] = out  # an output holding objects (a cache) is made afresh each time
    return out


def _call_key(tree: Any) -> Any:
    """What a call's output structure can depend on: its tensors' shapes and dtypes, its plain values and
    the types of its other objects."""
    leaves, spec = pytree.tree_flatten(tree)
    return str(spec), tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor)
                            else x if isinstance(x, _PLAIN) else type(x) for x in leaves)


def _ghost_forward(runtime: PipelineRuntime, name: str) -> Any:
    device = get_engine().device

    def forward(*args: Any, **kwargs: Any) -> Any:
        return pytree.tree_map(lambda x: _placeholder(x, device), _meta_output(runtime, name, args, kwargs))
    return forward


def _own_forward(runtime: PipelineRuntime, name: str, stage: int, forward: Any) -> Any:
    """A block of this rank's stage ``stage``: a ghost while a torch schedule runs another of its stages."""
    ghost = _ghost_forward(runtime, name)

    def own(*args: Any, **kwargs: Any) -> Any:
        run = runtime.run
        if run is not None and run.active not in (None, stage):
            return ghost(*args, **kwargs)
        return forward(*args, **kwargs)
    return own


def _receive_forward(runtime: PipelineRuntime, name: str, stage: int) -> Any:
    """The previous stage's last block, on the rank of stage ``stage``: its output as that stage sent it."""
    device = get_engine().device
    ghost = _ghost_forward(runtime, name)

    def forward(*args: Any, **kwargs: Any) -> Any:
        run = runtime.run
        assert run is not None
        if run.active not in (None, stage):
            return ghost(*args, **kwargs)
        structure = _meta_output(runtime, name, args, kwargs)
        leaves, spec = pytree.tree_flatten(structure)
        expected = [(tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor)]
        index = runtime.transfer_index(run.micro, stage - 1)
        run.received.add(index)
        if run.given is not None:
            got = list(run.given)
        else:
            hop = Hop(runtime.ends.comm, runtime.section.rank_of(stage - 1), index, f"{runtime.ends.label}: {name}")
            got = list(RecvActivations.apply(hop, anchor(device)))
        if [(tuple(t.shape), t.dtype) for t in got] != expected:
            raise PipelineError(f"stage {stage - 1} sent {[(tuple(t.shape), t.dtype) for t in got]} as "
                                f"{name!r}'s output, but stage {stage} computes {expected} for it: the stages built "
                                "different models or got different inputs")
        it = iter(got)
        return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    return forward


def _send_hook(runtime: PipelineRuntime, stage: int) -> Any:
    """After stage ``stage``'s last block: its output goes to the next stage; the forward stops after this
    rank's last stage."""
    name = runtime.section.stages[stage].blocks[-1]

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        run = runtime.run
        # None: a forward outside the pipeline's own (a capture on real inputs), no stage to feed; another
        # active stage: this block was a ghost
        if run is None or run.active not in (None, stage):
            return
        tensors = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
        if run.taken is not None:
            run.taken.extend(tensors)
            raise _StageDone
        index = runtime.transfer_index(run.micro, stage)
        hop = Hop(runtime.ends.comm, runtime.section.rank_of(stage + 1), index, f"{runtime.ends.label}: {name}")
        run.tokens.append(SendActivations.apply(hop, *tensors))
        run.sent.add(index)
        if stage == runtime.mine[-1]:
            raise _StageDone
    return hook


# ---- the forward ------------------------------------------------------------------------------------------
def install_pipeline_forward(model: nn.Module, runtime: PipelineRuntime) -> None:
    """Replace the model's forward (an instance attribute with its signature) by the pipelined one."""
    original = model.forward
    accepts_items = _accepts_num_items(model, original)
    runtime.accepts_items = accepts_items

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if runtime.run is not None:  # one micro-batch of a torch schedule (pipeline_schedule.py)
            return original(*args, **kwargs)
        return _pipelined(model, runtime, original, accepts_items, args, kwargs)

    model.forward = forward


def _accepts_num_items(model: nn.Module, forward: Any) -> bool:
    """A transformers model with its own loss: ``num_items_in_batch`` makes its micro-batch losses sum to the
    whole batch's mean."""
    if not hasattr(model, "loss_function"):
        return False
    params = inspect.signature(forward).parameters
    return "num_items_in_batch" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _pipelined(model: nn.Module, runtime: PipelineRuntime, original: Any, accepts_items: bool,
               args: tuple, kwargs: dict) -> Any:
    # Micro-batches pipeline a training step's backward; a forward without gradients (generate's steps,
    # whose KV cache one call fills for the whole batch) runs the batch whole.
    micros = runtime.section.microbatches if torch.is_grad_enabled() else 1
    batch = _batch_size(args, kwargs)
    _check_inputs(runtime, args, kwargs, batch, micros)
    calls = [_micro_call(args, kwargs, batch, micros, m) for m in range(micros)]
    items = _items_in_batch(accepts_items, kwargs)
    placeholders = ghost_placeholders(runtime)
    outputs, run = [], _Run()
    failure: Exception | None = None
    runtime.run = run
    engine = get_engine()
    _hold(runtime, model)
    try:
        with installed(placeholders):
            for m, (a, k) in enumerate(calls):
                run.micro = m
                # Micro-batch 0's backward runs last (autograd's order): the others only accumulate their
                # blocks' gradients, and its reduce-scatter carries the step's sum.
                engine.defer_reduce = m > 0 and torch.is_grad_enabled()
                if items is not None:
                    k = {**k, "num_items_in_batch": items}
                if failure is None:
                    try:
                        outputs.append(original(*a, **k))
                    except _StageDone:
                        pass
                    except Exception as exc:  # every stage must hear of it: see below
                        failure = exc
                if failure is not None:
                    _settle(runtime, run, m)
    finally:
        runtime.run = None
        engine.defer_reduce = False
        if not (torch.is_grad_enabled() and failure is None):
            _release(runtime)
    # A stage whose forward raised took its inputs and told the next stage instead of sending, so every
    # stage reaches this all-reduce: each raises the failing rank's error.
    agree(failure, what="pipeline forward", error_type=PipelineError)
    out = _combine(runtime, outputs, run.tokens, [batch // micros] * micros, batch, items is not None)
    return _own_objects(out, kwargs) if not runtime.last_stage else out


def _items_in_batch(accepts_items: bool, kwargs: dict) -> Any:
    """The whole batch's count of tokens a transformers causal loss divides by, for its micro-batches: the
    caller's own (transformers' Trainer passes it), else counted from the labels; None for a mean loss."""
    # Given, it already makes each micro-batch's loss a share of the batch's: they sum, not average (weighting
    # them as means divided the Trainer's loss and gradients by the micro-batch count).
    if kwargs.get("num_items_in_batch") is not None:
        return kwargs["num_items_in_batch"]
    if accepts_items and kwargs.get("labels") is not None:
        return int((kwargs["labels"][..., 1:] != -100).sum())
    return None


def ghost_placeholders(runtime: PipelineRuntime) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Zero placeholders for the other stages' parameters the root's own code reads directly."""
    device = get_engine().device
    return [(m, attr, torch.zeros((), dtype=dtype, device=device).expand(shape))
            for m, attr, shape, dtype in runtime.ghost_params]


def _own_objects(out: Any, kwargs: dict) -> Any:
    """On a stage that did not compute the output: an object the caller passed in and the output hands back
    (generate's KV cache, which this stage's own layers filled) is this stage's own."""
    if isinstance(out, dict):
        for key, value in kwargs.items():
            if key in out and out[key] is None and value is not None and not isinstance(value, torch.Tensor):
                out[key] = value
    return out


def _hold(runtime: PipelineRuntime, model: nn.Module, until_backward_ends: bool = True) -> None:
    """Gather this stage's blocks once for the step (torchtitan's choice under pipelining): every
    micro-batch's forward and recompute then communicates nothing; released when the backward ends (or,
    not ``until_backward_ends``, by the caller's ``_release``: a schedule runs one backward per micro-batch)."""
    _release(runtime)  # a backward that raised left them held
    engine = get_engine()
    finalize = engine.reducer.on_finalize  # earlier steps' releases (run, or of models that are gone)
    finalize[:] = [f for f in finalize if not (isinstance(f, _ReleaseAtEnd) and f.runtime() in (None, runtime))]
    groups = [model.get_submodule(b)._bmt_group for s in runtime.mine for b in runtime.section.stages[s].blocks]
    for g in groups:
        g.start_gather()
    for g in groups:
        g.wait_gathered()
        g.in_use += 1
    runtime.held = groups
    if until_backward_ends:
        engine.reducer.on_finalize.append(_ReleaseAtEnd(weakref.ref(runtime)))


@dataclass
class _ReleaseAtEnd:
    """The end of a backward gives back what ``_hold`` gathered; weak, so a dropped model goes."""

    runtime: weakref.ref[PipelineRuntime]

    def __call__(self) -> None:
        runtime = self.runtime()
        if runtime is not None:
            _release(runtime)


def _release(runtime: PipelineRuntime) -> None:
    """Give back what ``_hold`` gathered (once)."""
    held, runtime.held = runtime.held, []
    for g in held:
        g.in_use -= 1
        if g.in_use == 0:
            g.release()
            g.recycle()


def _settle(runtime: PipelineRuntime, run: _Run, m: int) -> None:
    """After this rank failed: for each of its stages in turn, take micro-batch ``m``'s activations if they
    were not taken, and tell the next stage in place of sending, so no stage waits for one that left."""
    ends, device, section = runtime.ends, get_engine().device, runtime.section
    for s in runtime.mine:
        index = runtime.transfer_index(m, s - 1)
        if s > 0 and index not in run.received:
            drain(ends.comm, section.rank_of(s - 1), forward_tag(index), f"{ends.label}: {runtime.boundary(s)}",
                  device)
        index = runtime.transfer_index(m, s)
        if s < runtime.count - 1 and index not in run.sent:
            send_failure(ends.comm, section.rank_of(s + 1), forward_tag(index),
                         f"{ends.label}: {section.stages[s].blocks[-1]}", device)


def _batch_size(args: tuple, kwargs: dict) -> int:
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0),
                 None)
    if first is None:
        raise PipelineError("a pipelined model's forward needs a batched tensor input (dim 0 is the batch) to cut "
                            "into micro-batches")
    return first.shape[0]


def _check_inputs(runtime: PipelineRuntime, args: tuple, kwargs: dict, batch: int, micros: int) -> None:
    """One all-reduce over the job: a batch the micro-batches do not divide, and stages of one pipeline
    given different batches, fail every rank alike."""
    error = None
    if batch % micros:
        error = PipelineError(f"a batch of {batch} cannot be cut into {micros} micro-batches "
                              f"(BMTrainModelWrapper(pp_microbatches={micros})): pass a batch divisible by it, or "
                              "another pp_microbatches")
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    table = agree(error, [_digest(tensors)], what="pipeline inputs")
    state, mesh = get_state(), runtime.layout.mesh
    peers = mesh.group(state.rank, ("pp",))
    raise_if_stages_differ([table[r][0] for r in peers], "the inputs", runtime.layout.dp_rank)


def _micro_call(args: tuple, kwargs: dict, batch: int, micros: int, m: int) -> tuple[tuple, dict]:
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x.chunk(micros)[m]
        return x
    return pytree.tree_map(cut, args), pytree.tree_map(cut, kwargs)


def _loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else None
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _combine(runtime: PipelineRuntime, outputs: list[Any], tokens: list[torch.Tensor], rows: list[int],
             batch: int, counted: bool) -> Any:
    """The whole batch's output on every stage: the last stage's micro-batch outputs joined, the loss (or,
    without one, every tensor of the output) shared with the other stages."""
    ends = runtime.ends
    shared: list[torch.Tensor] = []
    whole, kind = None, None
    if ends.last:
        whole = _join(outputs, rows, batch)
        losses = [_loss_of(o) for o in outputs]
        if all(loss is not None for loss in losses):
            # transformers' losses were divided by the whole batch's token count: they sum to its mean;
            # other losses are micro-batch means, weighted by their share of the batch.
            total = sum(losses) if counted else sum(loss * (r / batch) for loss, r in zip(losses, rows, strict=True))
            kind, shared = ("loss", _structure(whole)), [total]
        else:
            kind = ("output", _structure(whole))
            shared = [x for x in pytree.tree_leaves(whole) if isinstance(x, torch.Tensor)]
    kind = pickle.loads(_share_bytes(ends, pickle.dumps(kind) if ends.last else None))
    result = iter(ShareOutput.apply(ends, len(shared), *shared, *tokens))
    if kind[0] == "loss":
        return _set_loss(whole if ends.last else kind[1], next(result))
    return _fill(whole if ends.last else kind[1], result)


class _Slot:
    """Where a tensor sits in an output's structure (sent to the stages that did not compute it)."""


_PLAIN = (int, float, bool, str, bytes, type(None))


def _structure(out: Any) -> Any:
    """``out`` with its tensors marked and objects that are not plain values (a KV cache) dropped."""
    return pytree.tree_map(lambda x: _Slot() if isinstance(x, torch.Tensor) else x if isinstance(x, _PLAIN) else None,
                           out)


def _fill(structure: Any, values: Any) -> Any:
    return pytree.tree_map(lambda x: next(values) if isinstance(x, (_Slot, torch.Tensor)) else x, structure)


def _set_loss(out: Any, loss: torch.Tensor) -> Any:
    """``out`` (an output, or a structure of one) with ``loss`` as its loss; other tensors of a structure
    (what only the last stage computed) None."""
    if isinstance(out, (_Slot, torch.Tensor)):
        return loss
    out = pytree.tree_map(lambda x: None if isinstance(x, _Slot) else x, out)
    out["loss"] = loss
    return out


def _join(outputs: list[Any], rows: list[int], batch: int) -> Any:
    """The micro-batches' outputs as one: tensors of the micro-batches' rows concatenated, scalars weighted by
    each micro-batch's share of the batch, other values the last micro-batch's; objects (a KV cache) and the
    fused loss's lazy logits dropped. One micro-batch's output is returned as it is."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[-1][1]
    joined = []
    for i, last in enumerate(flat[-1][0]):
        parts = [f[0][i] for f in flat]
        if isinstance(last, LazyLogits):  # fused_loss=True: joining them would compute them whole
            joined.append(None)
        elif isinstance(last, torch.Tensor) and last.dim() > 0 and all(
                p.shape[0] == r for p, r in zip(parts, rows, strict=True)):
            joined.append(torch.cat(parts))
        elif isinstance(last, torch.Tensor) and last.dim() == 0 and last.is_floating_point():
            joined.append(sum(p * (r / batch) for p, r in zip(parts, rows, strict=True)))
        else:
            joined.append(last if isinstance(last, (*_PLAIN, torch.Tensor)) else None)
    return pytree.tree_unflatten(joined, spec)


def _share_bytes(ends: Ends, data: bytes | None) -> bytes:
    """The last stage's ``data`` on every stage (two broadcasts over the pipe group)."""
    last = ends.comm.world_size - 1
    device = get_engine().device
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    ends.comm.broadcast(length, last, label=f"{ends.label} output structure length")
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if data is not None:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    ends.comm.broadcast(payload, last, label=f"{ends.label} output structure")
    return bytes(payload.cpu().numpy().tobytes())


# ---- wrapping ---------------------------------------------------------------------------------------------
def pipeline_options(layout: ParallelLayout, microbatches: int | None, plan: WrapPlan | None,
                     virtual: int | None = None) -> tuple[int, int, int] | None:
    """(ranks, micro-batches, stages per rank) the wrapper cuts the model into, or None without pipeline
    parallelism; ``PipelineError`` on every rank alike for what cannot run."""
    if virtual is not None:
        check_virtual(virtual)
    if layout.pp_size == 1:
        if microbatches not in (None, 1):
            raise PipelineError(f"pp_microbatches={microbatches} without pipeline stages: pass pp_size= too")
        if virtual not in (None, 1):
            raise PipelineError(f"pp_virtual_stages={virtual} without pipeline stages: pass pp_size= too")
        return None
    given = plan.pipeline if plan is not None and plan.pipeline is not None else None
    m = microbatches if microbatches is not None else (given.microbatches if given else None) or layout.pp_size
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise PipelineError(f"pp_microbatches={microbatches!r}: a positive int")
    v = virtual if virtual is not None else given.virtual if given else 1
    return layout.pp_size, m, v


def check_pipeline_section(plan: WrapPlan, layout: ParallelLayout,
                           options: tuple[int, int, int] | None) -> Stages | None:
    """This rank's ``Stages`` for ``plan``'s pipeline section, checked against the job's layout."""
    section = plan.pipeline
    if options is None:
        if section is not None and section.size > 1:
            raise PlanError(f"plan= was made for {section.size} pipeline stages; this job wraps without "
                            "pipeline parallelism: pass the same pp_size=, or make the plan again")
        return None
    if section is None:
        raise PlanError("plan= has no pipeline section: use model.plan of a model wrapped with pp_size=")
    if section.size != options[0]:
        raise PlanError(f"plan= was made for {section.size} pipeline stages, this job has {options[0]}; make "
                        "the plan again for this size")
    if section.virtual != options[2]:
        raise PlanError(f"plan= was made for pp_virtual_stages={section.virtual}, this job asks for {options[2]}; "
                        "pass the same, or make the plan again")
    section.microbatches = options[1]
    return Stages(section, layout)


def apply_pipeline(model: nn.Module, stages: Stages, skeleton: nn.Module) -> None:
    """After ``apply_plan(stages=)``: ghosts compute placeholders, this stage's last block sends its output
    on, and the model's forward runs micro-batch by micro-batch."""
    runtime = PipelineRuntime(model, stages.section, stages.layout, skeleton)
    section = stages.section
    ghost_blocks = [b for i, s in enumerate(section.stages) if section.rank_of(i) != stages.mine for b in s.blocks]
    ghost_locations = [(m, attr) for _, m, attr, p in registrations(model)
                       if isinstance(p, DistributedParameter) and isinstance(p.flat_buffer, GhostBuffer)]
    install_ghosts(model, runtime, ghost_blocks, ghost_locations)
    install_pipeline_forward(model, runtime)
    model._bmt_pipeline = runtime
