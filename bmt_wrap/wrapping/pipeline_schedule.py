"""``model.pipeline_step(...)``: one training step, forward and backward over the micro-batches, in the order
of a schedule of ``torch.distributed.pipelining`` (docs/design.md, "Pipeline schedules").

The loop users write (``model(...)``, ``loss.backward()``) runs the order autograd allows: GPipe. Other
orders need the whole step in one call. This one hands torch's schedule a ``PipelineStage`` around this
rank's part of the model: the stage's module runs the model's own forward for one micro-batch as the GPipe
loop does (ghosts for other stages' modules, ``pipeline.py``), but takes the previous stage's activations
from the schedule's receive and gives its last block's output to the schedule's send. Torch orders the
forwards and backwards and moves activations and gradients over the pipe group's torch process group; its
metadata is given up front (static mode) from a meta run of the skeleton, so torch runs no extra forward.

With V stages per rank (``pp_virtual_stages``), the rank hands torch's multi-stage schedule (Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble) one ``PipelineStage`` per stage it runs, each the same model's forward with
only that stage's blocks real (``_Run.active``); torch maps stage ``s`` to rank ``s % P``, as the plan placed it.

ZeRO-3 under a schedule: the rank's blocks are gathered once for the step; every backward but a stage's
last accumulates unreduced (``no_sync``'s accumulators, over every group of the rank but that stage's on its
last backward), and a stage's last backward reduce-scatters the step's sum of its blocks (torch passes
``last_backward``); the root's groups go with the first and last stage. The stages' agreement (a tied
weight's summed gradient, which parameters got one) runs once after the schedule: a pipe-group collective
inside one stage's backward would wait for a stage that waits for this one's gradients.

InterleavedZeroBubble splits each backward in two: the inputs' gradients (B, torch's ``stage_backward_input``
given the stage's shards, whose nodes lie behind each block's ``BlockParams`` node), and later the weights'
(W, ``_weights_backward``), which reaches ``BlockParams`` and so the reducer. A block call keeps its
recompute's tensors from B to W (``BlockCall.split``) and ends after W; a stage's last W reduces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from ..base._compat import pytree, stage_backward_input
from ..errors import PipelineError, PipelineScheduleError, UnsupportedError
from ..job.distributed import agree
from ..passes.capture import to_meta
from ..runtime.active_engine import get_engine
from ..runtime.block_executor import BlockCall
from ..runtime.group import StorageMode
from ..runtime.module_params import installed
from ..runtime.pipeline import broadcast_tensors, clear_action_times, count_transfer_time, record_action
from .grad_sync import discard_unsynced, module_groups, no_sync_groups
from .pipeline import (
    PipelineRuntime,
    _batch_size,
    _call_key,
    _check_inputs,
    _hold,
    _items_in_batch,
    _loss_of,
    _micro_call,
    _release,
    _Run,
    _StageDone,
    ghost_placeholders,
)

#: The schedules ``pipeline_step`` offers with one stage per rank (``pp_virtual_stages=1``): torch's.
SCHEDULES: dict[str, type] = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
#: Those it offers with any number of stages per rank (the plan's stage ``s`` on rank ``s % P``).
MULTI: dict[str, type] = {"Interleaved1F1B": ScheduleInterleaved1F1B, "LoopedBFS": ScheduleLoopedBFS,
                          "InterleavedZeroBubble": ScheduleInterleavedZeroBubble}
#: Those whose stages split each backward into the inputs' gradients (B) and, later, the weights' (W).
SPLIT = (ScheduleInterleavedZeroBubble,)

_V_SHAPE = ("it places stage s on rank s or 2P-1-s (a V), while the plan places stage s on rank s % P, and the "
            "last stage (the loss and the head) on the last rank (docs/design.md, 'Pipeline schedules')")
#: Torch's other schedules, and why they are not offered here.
NOT_OFFERED = {"ZBVZeroBubble": _V_SHAPE, "DualPipeV": _V_SHAPE}


def schedule_class(schedule: str, virtual: int = 1) -> type:
    """Torch's schedule class for ``schedule`` with ``virtual`` stages per rank; ``PipelineScheduleError``
    naming what is offered otherwise."""
    offered = ", ".join(repr(s) for s in ({**SCHEDULES, **MULTI} if virtual == 1 else MULTI))
    if schedule in MULTI or (schedule in SCHEDULES and virtual == 1):
        return {**SCHEDULES, **MULTI}[schedule]
    if schedule in SCHEDULES:
        raise PipelineScheduleError(f"model.pipeline_step(schedule={schedule!r}) runs one stage per rank, but the "
                                    f"model was wrapped with pp_virtual_stages={virtual}: use one of {offered}")
    if schedule in NOT_OFFERED:
        raise PipelineScheduleError(f"model.pipeline_step(schedule={schedule!r}) is not offered: "
                                    f"{NOT_OFFERED[schedule]}. Use one of {offered}")
    raise PipelineScheduleError(f"model.pipeline_step(schedule={schedule!r}): no such schedule; use one of {offered}")


class _StageModule(nn.Module):
    """Stage ``stage`` of the model (one of this rank's) for one micro-batch: the model's own forward, fed the
    activations the schedule received; returns the stage's last block's output tensors (sent on), or on the
    last stage the micro-batch's share of the batch's loss. The model is not a submodule: torch's stage
    reads no parameters of it (``scale_grads=False``; a split backward is given the rank's shards,
    ``_Stage.weights``)."""

    def __init__(self, runtime: PipelineRuntime, model: nn.Module, stage: int) -> None:
        super().__init__()
        self.runtime, self.stage = runtime, stage
        self.call_model = model.__call__  # its hooks (the root's gathers) run per micro-batch; not a submodule
        self.calls: list[tuple[tuple, dict]] = []
        self.weights: list[float] = []  # each micro-batch loss's weight in the batch's loss
        self.micro = 0
        self.sends: tuple[torch.Tensor, ...] = ()  # examples of what it returns per micro-batch
        self.failure: Exception | None = None  # what this stage's forward or backward raised during the step

    def forward(self, *received: torch.Tensor) -> Any:
        runtime = self.runtime
        run = runtime.run
        assert run is not None
        run.micro, run.given, run.taken = self.micro, received if self.stage > 0 else None, []
        run.active = self.stage
        args, kwargs = self.calls[self.micro]
        if self.failure is None:
            try:
                out = self.call_model(*args, **kwargs)
            except _StageDone:
                return tuple(run.taken)
            except Exception as exc:  # the other stages must hear of it: see pipeline_step
                self.failure = exc
            else:
                loss = _loss_of(out)
                assert loss is not None  # checked on the meta skeleton before the schedule ran
                return loss * self.weights[self.micro]
        # After a failure the stage keeps the schedule's transfers going with zeros, so no stage waits for
        # one that left (the GPipe loop's failure headers, in torch's fixed order); nothing reads them.
        stand_in = tuple(torch.zeros_like(t, requires_grad=t.is_floating_point()) for t in self.sends)
        return stand_in[0] if self.stage == runtime.count - 1 else stand_in


class _Stage(PipelineStage):
    """Torch's stage, told which micro-batch each forward is for, where ZeRO-3 reduces, and (``split``: a
    zero-bubble schedule) which weights its backward's second pass reaches."""

    def __init__(self, module: _StageModule, model: nn.Module, group: Any, inputs: tuple, outputs: tuple,
                 split: bool) -> None:
        runtime = module.runtime
        super().__init__(module, module.stage, runtime.count, get_engine().device, input_args=inputs,
                         output_args=outputs, group=group)
        self.model = model
        self.compute = 0.0  # seconds in this stage's forwards and backwards during the step
        # What its last backward reduces: its blocks' groups, and the root's on the first and last stage (the
        # ends' own parameters); every other group of the rank stays accumulating until its stage's turn.
        stages = runtime.section.stages
        blocks = {id(model.get_submodule(b)._bmt_group) for s in stages for b in s.blocks}
        every = module_groups(model)
        mine = {id(model.get_submodule(b)._bmt_group) for b in stages[module.stage].blocks}
        ends = module.stage in (0, runtime.count - 1)
        reduced = [g for g in every if id(g) in mine or (ends and id(g) not in blocks)]
        self.others = [g for g in every if g not in reduced]
        self.every = every
        # A zero-bubble schedule's weights (W) pass runs to these: the shards behind this stage's block and
        # root nodes, which hand the gradients to the reducer (torch's default, the stage module's own
        # parameters, is none here). Each micro-batch's block calls end after its W (``end_calls``).
        self.split = split
        self.weights = [p for g in reduced if not g.ghost for b in g.buffers if b.spec.requires_grad for p in b.params]
        self.split_calls: dict[int, list[BlockCall]] = {}

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True) -> Any:
        """Torch's forward of micro-batch ``fwd_chunk_id``, timed."""
        self.submod.micro = fwd_chunk_id
        engine = get_engine()
        engine.split_calls = [] if self.split else None
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            if engine.split_calls is not None:
                self.split_calls[fwd_chunk_id] = engine.split_calls
            engine.split_calls = None
            self.compute += time.perf_counter() - start
            record_action("F", self.stage_index, fwd_chunk_id, time.thread_time() - cpu)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        """Torch's backward of one micro-batch; one that raises is kept for the step's end, as a forward's is
        (``pipeline_step``), and this stage's later backwards run nothing: torch sends the previous stage
        zeros for the missing gradients, so no stage waits for one that left the schedule."""
        module = self.submod
        if module.failure is None:
            try:
                if backward_type == "input":  # B: torch's, to this stage's shards' nodes (see __init__)
                    return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                                bwd_kwargs["input_values"], iter(self.weights))
                if backward_type == "weight":
                    _weights_backward(bwd_kwargs["param_groups"])
                    return (), None
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            except Exception as exc:
                # torch wraps what the backward raised in a RuntimeError naming the stage's tensors
                module.failure = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        return tuple(None for _ in bwd_kwargs.get("input_values", ())), None

    @contextmanager
    def _backward(self, kind: str, micro: int, last_backward: bool) -> Iterator[None]:
        """One backward (torch's action ``kind``) of micro-batch ``micro``, timed: the stage's last one reduces
        the step's sum."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            with no_sync_groups(self.others if last_backward else self.every):
                yield
        finally:
            self.compute += time.perf_counter() - start
            record_action(kind, self.stage_index, micro, time.thread_time() - cpu)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """Torch's backward of micro-batch ``bwd_chunk_id`` (or its inputs' part, B)."""
        with self._backward("B" if full_backward else "I", bwd_chunk_id, last_backward):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """Torch's weights' part (W) of micro-batch ``bwd_chunk_id``'s backward (the first stage's whole
        backward); then the micro-batch's block calls end, with the recomputed tensors B kept for W."""
        try:
            with self._backward("W", bwd_chunk_id, last_backward):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        finally:
            self.end_calls(bwd_chunk_id)

    def end_calls(self, micro: int | None = None) -> None:
        """End micro-batch ``micro``'s block calls (None: every one left, as after a step that failed)."""
        for m in list(self.split_calls) if micro is None else [micro]:
            for call in self.split_calls.pop(m, []):
                call.finish_split()


def _weights_backward(param_groups: list[dict[str, Any]] | None) -> None:
    """Torch's weights' pass (``stage_backward_weight``) in one autograd call: from the nodes where the weights'
    paths leave the inputs' (recorded by B in ``param_groups``, with the gradients they got there) to the
    weights. Torch makes one call per group; here each call is a backward to ZeRO-3, whose end settles the
    reductions, so one per micro-batch. In one call a later block's node also reaches an earlier one's along
    the inputs' path, so every recorded node is held to B's gradients (torch does so within a group). The
    weights get nothing from autograd (their block's node hands the gradients to the reducer): allow_unused."""
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    weights: dict[Any, None] = {}
    hooks = []
    try:
        for group in param_groups or ():
            nodes, got = group.pop("intermediates"), group.pop("grads", None) or []
            weights.update(dict.fromkeys(group["params"]))
            for i, node in enumerate(nodes):
                saved = got[i] if i < len(got) else None
                hooks.append(node.register_prehook(
                    lambda outs, saved=saved: saved if saved is not None else tuple(None for _ in outs)))
                for k, g in enumerate(saved or ()):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
        if edges:
            torch.autograd.grad(edges, [GradientEdge(w, 0) for w in weights], grads, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()


def pipeline_step(model: nn.Module, args: tuple, kwargs: dict, schedule: str | None) -> torch.Tensor:
    """Run one step's forwards and backwards over the micro-batches with torch's ``schedule`` (None: 1F1B, or
    Interleaved1F1B with several stages per rank); the whole batch's loss on every stage (gradients in
    ``.grad`` as after ``loss.backward()``)."""
    runtime: PipelineRuntime | None = getattr(model, "_bmt_pipeline", None)
    if runtime is None:
        raise PipelineError(f"{type(model).__name__}.pipeline_step() runs a pipeline schedule, but the model has no "
                            "pipeline stages: wrap it with BMTrainModelWrapper(model, pp_size=P) with P > 1 (or "
                            "init_distributed(pipe_size=P)), or train with loss = model(...); loss.backward()")
    virtual = runtime.section.virtual
    schedule = schedule if schedule is not None else "1F1B" if virtual == 1 else "Interleaved1F1B"
    cls = schedule_class(schedule, virtual)
    micros, size = runtime.section.microbatches, runtime.section.size
    if not torch.is_grad_enabled():
        raise PipelineError("model.pipeline_step() runs a training step's backward: call it with gradients enabled "
                            "(not under torch.no_grad()); evaluate with model(...)")
    if cls is Schedule1F1B and micros < size:
        raise PipelineError(f"model.pipeline_step(schedule='1F1B') needs at least as many micro-batches as stages: "
                            f"pp_microbatches={micros} < pp_size={size}; wrap with pp_microbatches >= {size}")
    rounds = max(1, micros // size)  # torch's interleaved 1F1B runs the micro-batches in rounds of P
    if cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) and micros % rounds:
        raise PipelineError(f"model.pipeline_step(schedule={schedule!r}) runs the micro-batches in "
                            f"max(1, M // P) = {rounds} equal rounds: pp_microbatches={micros} is not a multiple of "
                            f"{rounds} (pp_size={size}); wrap with pp_microbatches a multiple of {size}")
    batch = _batch_size(args, kwargs)
    _check_inputs(runtime, args, kwargs, batch, micros)
    if any(t.requires_grad for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
        raise PipelineError("model.pipeline_step() takes inputs that need no gradient (token ids, labels); for "
                            "gradients of an input, train with loss = model(...); loss.backward()")
    if getattr(model, "_bmt_first_forward", None) is not None:
        # The block order is captured at the first call, with collectives over the job that every stage must
        # reach together: one forward without gradients, before the schedule runs the stages apart.
        with torch.no_grad():
            model(*args, **kwargs)
    items = _items_in_batch(runtime.accepts_items, kwargs)
    calls = [_micro_call(args, kwargs, batch, micros, m) for m in range(micros)]
    if items is not None:
        calls = [(a, {**k, "num_items_in_batch": items}) for a, k in calls]
    stages, sched = _scheduled(runtime, model, cls, schedule, calls[0])
    for stage in stages:
        stage.submod.calls, stage.submod.failure = calls, None  # a step that raised out of the schedule left one
        # transformers' losses were divided by the whole batch's token count: they sum to its mean; other
        # losses are micro-batch means, weighted by their share of the batch.
        stage.submod.weights = [1.0 if items is not None else 1.0 / micros] * micros
    losses: list[torch.Tensor] = []
    engine = get_engine()
    _hold(runtime, model, until_backward_ends=False)
    _hold_root(runtime, model)
    runtime.run = _Run()
    for stage in stages:
        stage.compute = 0.0
    clear_action_times()
    start = time.perf_counter()
    try:
        with installed(ghost_placeholders(runtime)), engine.reducer.stages_agree_after():
            _run_schedule(sched, micros, losses, runtime)
            failure = next((stage.submod.failure for stage in stages if stage.submod.failure is not None), None)
            for stage in stages:
                stage.submod.failure = None
            if failure is not None:
                discard_unsynced(model)  # earlier micro-batches' unreduced sums: the step is void
            # A stage whose forward or backward raised ran the schedule to its end with zeros, so every rank
            # reaches this all-reduce over the job: each raises the failing rank's error, before the stages'
            # agreement.
            agree(failure, what="pipeline_step", error_type=PipelineError)
    finally:
        runtime.run = None
        for stage in stages:
            stage.end_calls()  # calls whose W never ran (a failed step): their recomputed tensors go
        _release(runtime)
    # what the rank waited for its peers
    count_transfer_time(time.perf_counter() - start - sum(stage.compute for stage in stages))
    ends = runtime.ends
    total = [torch.stack([loss.detach() for loss in losses]).sum()] if ends.last else None
    return broadcast_tensors(ends.comm, total, ends.comm.world_size - 1, f"{ends.label} loss", engine.device)[0]


def _run_schedule(sched: Any, micros: int, losses: list[torch.Tensor], runtime: PipelineRuntime) -> None:
    """``sched.step``; torch's point-to-point wait timing out (a peer that died or left the schedule) is
    ``CommTimeoutError`` naming the pipe group, as our own transfers' is."""
    try:
        sched.step(target=torch.zeros(micros), losses=losses, return_outputs=False)
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise runtime.ends.comm.timeout_error(f"rank {runtime.stage} of the pipe group's point-to-point transfers "
                                              f"in torch's "
                                              f"{type(sched).__name__} ({runtime.ends.label})") from exc


def _hold_root(runtime: PipelineRuntime, model: nn.Module) -> None:
    """Keep the groups the root gathers per call (its own parameters) gathered for the step too, released
    with the blocks: once per step, as the GPipe loop's one model call gathers them. Regathered per
    micro-batch they would also be wrong: a backward takes the last gather's storage for its gradient (it
    knows no later graph reads it), while under a schedule another micro-batch's graph still does."""
    groups = [g for g in model._bmt_runtime.groups
              if g.mode is StorageMode.GRAPH and not g.ghost and g not in runtime.held]
    for g in groups:
        g.start_gather()
    for g in groups:
        g.wait_gathered()
        g.in_use += 1
    runtime.held.extend(groups)


def _scheduled(runtime: PipelineRuntime, model: nn.Module, cls: type, name: str,
               call: tuple[tuple, dict]) -> tuple[list[_Stage], Any]:
    """This rank's stages and torch's schedule for micro-batches shaped like ``call``, kept for the next
    steps (torch allocates its receive buffers once)."""
    key = (name, _call_key(call))
    if runtime.scheduled is not None and runtime.scheduled[0] == key:
        return runtime.scheduled[1], runtime.scheduled[2]
    group = runtime.ends.comm.process_group
    if group is None:
        raise UnsupportedError("model.pipeline_step() runs torch's schedules over the pipe group's torch process "
                               "group; this job's communicator has none (CuPy NCCL): init_distributed with "
                               "backend='nccl' or 'gloo', or train with loss = model(...); loss.backward()")
    tensors = _stage_tensors(runtime, call)
    stages = []
    for s in runtime.mine:
        inputs, outputs = tensors[s]
        module = _StageModule(runtime, model, s)
        module.sends = outputs
        stages.append(_Stage(module, model, group, inputs, outputs, split=cls in SPLIT))
    sched = cls(stages if cls in MULTI.values() else stages[0], runtime.section.microbatches,
                loss_fn=lambda out, target: out, scale_grads=False)
    runtime.scheduled = (key, stages, sched)
    return stages, sched


def _stage_tensors(runtime: PipelineRuntime, call: tuple[tuple, dict]) -> dict[int, tuple[tuple, tuple]]:
    """Examples of what each of this rank's stages receives and sends per micro-batch (torch's static
    metadata), from one run of the meta skeleton; ``PipelineError`` on every rank alike when the output
    carries no loss."""
    section, skeleton = runtime.section, runtime.skeleton
    sent: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for s, stage in enumerate(section.stages[:-1]):
        def hook(module: nn.Module, args: tuple, output: Any, s: int = s) -> None:
            sent[s] = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
        hooks.append(skeleton.get_submodule(stage.blocks[-1]).register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = skeleton(*to_meta(call[0]), **to_meta(call[1]))
    finally:
        for h in hooks:
            h.remove()
    loss = _loss_of(out)
    if loss is None:
        raise PipelineError(f"model.pipeline_step() trains on the model's loss, but {type(out).__name__} output "
                            "carries none: pass the targets (labels=) so that the forward returns a loss, or a "
                            "model whose forward returns its scalar loss")
    device = get_engine().device

    def example(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=t.is_floating_point())
    last = runtime.count - 1
    return {s: (tuple(example(t) for t in sent[s - 1]) if s > 0 else (),
                tuple(example(t) for t in sent[s]) if s < last else (example(loss),)) for s in runtime.mine}
