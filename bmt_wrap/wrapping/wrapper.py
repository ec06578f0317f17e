"""``BMTrainModelWrapper``: the one-liner. Runs the passes, applies the plan, fixes the schedule at the
first forward when the model could not be captured without inputs."""

from __future__ import annotations

import copy
import gc
import os
import warnings
from typing import Any

from torch import nn

from .. import passes
from ..base.expert_plan import ExpertPlan
from ..base.host_allocator import EXACT_SETTING, THRESHOLD_VAR, counts_exactly
from ..base.log import get_logger
from ..base.mixed_precision import MixedPrecision
from ..base.plan import WrapPlan
from ..base.tp_plan import TensorParallelPlan
from ..errors import PlanError, WrapError
from ..job.distributed import agree, broadcast_bytes, get_state, job_layout, use_layout
from ..runtime.comm import collective_purpose
from ..runtime.param import DistributedParameter
from .apply_plan import apply_plan, is_wrapped, update_schedule
from .bound_block import CheckpointBlock
from .consistency import check_same_wrap
from .context_parallel import apply_context_parallel, check_context_parallel
from .experts import apply_expert_parallel, expert_parallel_section, keep_own_list_experts, name_list_experts
from .fused_loss import install_fused_loss
from .generate import attach_generate
from .offload_option import check_offload
from .pipeline import apply_pipeline, check_pipeline_section, pipeline_options
from .sequence_parallel import adopt_sequence_chain
from .tensor_parallel import apply_tensor_parallel, guard_tp_inputs, tensor_parallel_section
from .verify import attach_verify


class _FirstForward:
    """Captures the block order at the first call (export of a meta copy, else hooks on the real call)
    and replaces the plan's schedule; rank 0 decides, every rank receives its choice."""

    def __init__(self, skeleton: nn.Module, discovery: passes.Discovery, options: dict[str, Any],
                 shard_size: int, fused_loss: bool) -> None:
        self.skeleton, self.discovery, self.options = skeleton, discovery, options
        self.shard_size, self.fused_loss = shard_size, fused_loss
        self.recorder: passes.EagerRecorder | None = None
        self.notes: list[str] = []

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Export a meta copy on these inputs; if that fails, record the real call about to run."""
        # Every object alive now leaves the collector's view until ``collect``: its full collection then
        # scans only what the capture and the first forward made (a few thousand objects, not the
        # process's hundreds of thousands: 0.2 s of every wrap in a process that imported transformers).
        gc.freeze()
        try:
            cap = passes.capture(self.skeleton, self.discovery, (args, kwargs))
        except BaseException:
            gc.unfreeze()
            raise
        if cap.method != "none":
            self._adopt(model, cap)
        else:
            self.notes = cap.notes
            self.recorder = passes.EagerRecorder(model, self.discovery).__enter__()

    def after(self, model: nn.Module) -> None:
        """The recorded real call ended: its block order is the schedule."""
        try:
            if self.recorder is not None:
                self.recorder.__exit__(None, None, None)
                self._adopt(model, passes.eager_capture(self.recorder, self.notes))
        finally:
            self.collect()

    @staticmethod
    def collect() -> None:
        """Free the capture's reference cycles now, then give the objects frozen by ``before`` back."""
        # The capture (export, tracing, planning) leaves thousands of objects in reference cycles. Left to
        # the collector's own schedule they live into the steady state (a full collection is rare) and
        # with them memory that grows with depth: 37 MiB of a 14-layer Llama's 2-rank job.
        gc.collect()
        gc.unfreeze()

    def _adopt(self, model: nn.Module, cap: passes.Capture) -> None:
        state = get_state()
        # Every rank captured the same model: each raises alike when its graph shows a split weight read elsewhere.
        passes.check_captured_reads(self.skeleton, model.plan.tensor_parallel, cap.readers)
        budgeted = self.options["memory_budget"] is not None
        mine, failure = None, None
        try:
            if model.plan.pipeline is not None and state.rank == 0:
                # Stages were placed from module order at wrap time; the captured forward must agree.
                passes.check_root_order(model.plan.pipeline, cap.graph, model.plan)
            section = passes.fused_loss_section(self.skeleton, cap, enabled=self.fused_loss,
                                                tensor_parallel=model.plan.tensor_parallel)
            mine = passes.schedule(model.plan, passes.with_fused_loss(cap, section), world_size=self.shard_size,
                                   **self.options)
            if cap.method == "export" and mine.tensor_parallel is not None and mine.tensor_parallel.sequence:
                mine.tensor_parallel.sequence = passes.chain_from_capture(mine.tensor_parallel.sequence, cap.graph)
        except PlanError as exc:  # a budget these inputs' activations exceed, or pipeline stages placed wrongly
            if not budgeted and model.plan.pipeline is None:
                raise
            failure = exc
        if budgeted or model.plan.pipeline is not None:
            # Every rank adopts rank 0's schedule, so rank 0's verdict is raised everywhere (another rank's
            # inputs may differ; it follows rank 0 either way). Without a budget nothing here can fail.
            agree(failure if state.rank == 0 else None, what="first-forward schedule", error_type=PlanError)
        chosen = WrapPlan.from_json(broadcast_bytes(mine.to_json().encode() if state.rank == 0 else None).decode())
        update_schedule(model, chosen)
        adopt_sequence_chain(model, chosen.tensor_parallel.sequence if chosen.tensor_parallel else None)
        install_fused_loss(model, chosen.fused_loss)
        get_logger().debug("first forward: block order captured by %s", chosen.capture)


def BMTrainModelWrapper(model: nn.Module, *, checkpoint: bool = True, zero_level: int = 3, prefetch_depth: int = 1,
                        memory_budget: int | None = None, plan: WrapPlan | None = None,
                        example_inputs: Any = None, mixed_precision: MixedPrecision | None = None,
                        mesh: Any = None, tp_size: int | None = None, tp_plan: dict[str, str] | None = None,
                        sequence_parallel: bool = False, fused_loss: bool = False, offload: str | None = None,
                        offload_dir: str | os.PathLike[str] | None = None, pp_size: int | None = None,
                        pp_microbatches: int | None = None, pp_virtual_stages: int | None = None,
                        ep_size: int | None = None, ep_capacity_factor: float | None = None,
                        cp_size: int | None = None, cp_method: str = "auto") -> nn.Module:
    """Shard ``model`` in place (ZeRO-3), checkpoint and prefetch its repeated blocks; returns ``model``.

    Blocks are found from the module tree (no hints needed); the block order comes from ``torch.fx``,
    ``torch.export`` of a meta copy (with ``example_inputs=`` or at the first call) or hooks on the first
    call. ``plan=`` re-applies a saved ``WrapPlan``; ``memory_budget=`` (bytes per rank) spends memory
    beyond ZeRO-3's on speed: blocks keep activations, then parameters gathered, then prefetch deepens
    (decided at the first forward when activations need its inputs; ``MemoryBudgetError`` when even full
    recompute exceeds it). ``model.plan`` holds the plan; ``model.verify(...)`` checks parity.
    ``mesh=``: a 2-D ``DeviceMesh`` with dims (replicate, shard) shards within each row and replicates
    across rows (HSDP); None or a 1-D mesh over every rank is ZeRO-3 over the whole job.
    ``tp_size=T`` (or a 2-D mesh with dims ("dp", "tp")): tensor parallelism over T adjacent ranks, ZeRO-3
    over the data-parallel ranks; a 3-D mesh with dims ("replicate", "shard", "tp") adds HSDP: ZeRO-3 within
    each shard group, gradients averaged across replicas (``rank = (replica x S + shard) x T + tp``); the modules split come from ``tp_plan=`` (transformers' vocabulary), the
    transformers model's own tp plan, or column -> row Linear pairs in its blocks (listed in
    ``model.plan.tensor_parallel``). ``sequence_parallel=True`` (with TP): norms, dropout and residual adds
    between the parallel Linears run on this TP rank's part of the sequence (Megatron-SP), where the plan
    proves it safe; ``model.plan.tensor_parallel.sequence`` says where and why not elsewhere.
    ``fused_loss=True``: the projection to the vocabulary and the cross-entropy it feeds run as one chunked op
    (the logits are never whole); a training call that computes the loss returns ``logits=None``.
    ``model.plan.fused_loss`` says what was found, or why not, and the logits' bytes at the captured input.
    ``offload="disk", offload_dir=D`` (CPU jobs): each rank's parameter shards, gradient shards and
    ``no_sync`` accumulators live in a file of its own under ``D`` (a disk, not tmpfs), read one block ahead
    of their gathers and out of memory once used (docs/offload.md); results are bit-equal to the same job
    without offload. Pair it with ``bmt.optim.AdamDiskOptimizer`` to put Adam's state in a file too.
    ``offload="host"`` (CUDA jobs): the same shards in pinned host memory, copied to the device one block
    ahead of their gathers; ``AdamOptimizer``'s state stays on the host and it steps chunk by chunk.
    ``pp_size=P`` (or a mesh dim named "pp", or ``init_distributed(pipe_size=P)``): pipeline parallelism over
    P stages of ``world / P`` consecutive ranks, each holding a contiguous run of blocks (balanced by their
    forward FLOPs, the head's and loss's counted on the last stage, when wrapped with ``example_inputs``; else
    by their parameter bytes) and the root parameters used before the first block (first stage) or after the last
    (last stage), ZeRO-3 sharded over its data-parallel ranks. The forward cuts the batch into
    ``pp_microbatches`` (default P) micro-batches and runs GPipe; every stage returns the whole batch's loss
    (``out.loss.backward()`` on every rank runs the schedule). The stages of a pipeline take the same batch:
    slice data by ``bmt.data_parallel_rank()``. ``model.plan.pipeline`` lists the stages.
    ``pp_virtual_stages=V`` (default 1) cuts P x V stages, rank r running stages r, r + P, ... (Megatron's
    interleaved layout), for ``model.pipeline_step(..., schedule="Interleaved1F1B" | "LoopedBFS")``.
    ``ep_size=E`` (or a mesh dim "ep" after the shard dim): expert parallelism over E ranks borrowed from the
    shard axis. The mixture-of-experts layers are found by structure (a router whose top-k indices choose
    among packed 3-D expert weights or a ModuleList of expert MLPs); each EP rank keeps ``num_experts / E`` of each layer's experts,
    ZeRO-3 sharded over the ranks owning the same ones, and tokens reach them and come back through
    all-to-all; the rest stays ZeRO-3 over every rank. ``model.plan.experts`` lists the layers and placement.
    No token is dropped unless ``ep_capacity_factor=F``: each expert then takes at most ceil(F x tokens x k /
    experts) of a rank's call's (token, expert) pairs, the first in token order; the rest add nothing (the
    residual carries those tokens), which changes results against the unwrapped model.
    ``cp_size=C`` (or a mesh dim "cp" between the shard and tp dims): context parallelism over C adjacent ranks,
    which take the same batch (``bmt.data_parallel_rank()`` says which) and split each training call's
    sequences between them (load-balanced: rank i holds chunks i and 2C-1-i of 2C); attention runs over the
    whole sequence by ``cp_method`` ("ulysses": all-to-all over heads, "ring": K/V passed around, "auto":
    Ulysses when there are at least C heads). transformers models whose attentions call its attention
    interface; the returned loss is the whole slice's; ZeRO-3 shards over the CP ranks too. Beside ``tp_size``,
    attention runs on each TP rank's heads (``sequence_parallel=True`` splits each rank's tokens again over
    the TP ranks between their TP regions); with HSDP replicas too; ``fused_loss=True`` runs on each rank's
    tokens. Not yet beside ``pp_size``/``ep_size`` (``UnsupportedError``).
    """
    state = get_state()
    if not isinstance(model, nn.Module):
        raise WrapError(f"BMTrainModelWrapper expects an nn.Module, got {type(model).__name__}")
    if is_wrapped(model):
        raise WrapError(f"{type(model).__name__} is already wrapped; BMTrainModelWrapper changes the model in "
                        "place and returns it, so call it once")
    _refuse_sharded_parts(model)
    check_offload(offload, offload_dir, state.device)
    if memory_budget is not None and state.device.type == "cpu":
        _warn_if_budget_inexact()
    with collective_purpose("wrap"):
        # Mesh and size errors first, on every rank alike; then the layout is the job's (sub-groups built once).
        wanted = job_layout(mesh, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, cp_size=cp_size)
        if wanted.cp > 1:  # the sizes and the model are alike on every rank: refused alike, before any group
            check_context_parallel(model, wanted, cp_method)
        parallel = use_layout(wanted)
        tp_layout = parallel if parallel.tp_size > 1 else None
        layout = parallel.dp
        pipeline = pipeline_options(parallel, pp_microbatches, plan, pp_virtual_stages)
        check_same_wrap(model, plan, example_inputs)  # before the first collective sized by the model
        options = {"checkpoint": checkpoint, "zero_level": zero_level, "prefetch_depth": prefetch_depth,
                   "memory_budget": memory_budget, "offload": offload}
        discovery = passes.discover_blocks(model)
        # Every rank plans TP itself (pure, deterministic): its errors come before any change, on every rank.
        tp = tensor_parallel_section(model, discovery, tp_layout, plan, tp_plan, sequence_parallel)
        # every rank, like TP's: errors alike
        experts = expert_parallel_section(model, parallel, plan, tp, ep_capacity_factor)
        if experts is not None:
            keep_own_list_experts(model, experts, parallel)  # rank 0 plans what every rank holds
        built = plan is None
        if plan is None:
            mine, failure = None, None
            if state.rank == 0:
                try:
                    mine = _plan_on_rank0(model, discovery, example_inputs, mixed_precision, options,
                                          layout.shard_size, tp, fused_loss, pipeline, experts)
                except Exception as exc:  # any: the other ranks wait for this plan, so they must hear of it
                    failure = exc
            agree(failure, what="planning", error_type=WrapError)  # every rank raises rank 0's error, or none
            plan = WrapPlan.from_json(broadcast_bytes(mine.to_json().encode() if mine else None).decode())
            _warn_if_no_blocks(model, plan, discovery)
        else:
            if not isinstance(plan, WrapPlan):
                raise PlanError(f"plan= must be a WrapPlan (WrapPlan.from_json(text)), got {type(plan).__name__}")
            plan = copy.deepcopy(plan)
            if plan.fused_loss is not None:
                plan.fused_loss.enabled = fused_loss
            elif fused_loss and plan.capture != "none":
                raise PlanError("plan= has no fused-loss section to apply fused_loss=True with: rebuild the plan "
                                "(bmt-wrap dump --fused-loss --format json) or wrap without plan=")
        first = None
        skeleton = passes.meta_skeleton(model) if plan.capture == "none" or pipeline is not None else None
        if plan.capture == "none" or (built and _budget_needs_activations(plan, layout.shard_size)):
            first = _FirstForward(skeleton or passes.meta_skeleton(model), discovery, options, layout.shard_size,
                                  fused_loss)
        if tp is not None:
            apply_tensor_parallel(model, tp, tp_layout.tp)
            guard_tp_inputs(model)
        if experts is not None:
            apply_expert_parallel(model, experts, parallel)
        stages = check_pipeline_section(plan, parallel, pipeline)
        apply_plan(model, plan, mixed_precision, layout=parallel, offload=offload, offload_dir=offload_dir,
                   stages=stages)
        if experts is not None:
            name_list_experts(model, experts, parallel)
        if stages is not None:
            assert skeleton is not None
            apply_pipeline(model, stages, skeleton)
        install_fused_loss(model, plan.fused_loss)
        if parallel.cp is not None:
            plan.notes.append(apply_context_parallel(model, parallel.cp, cp_method))
            plan.context_parallel = passes.plan_context_parallel(
                model, parallel.cp.world_size, cp_method, recomputed=sum(g.checkpoint for g in plan.blocks()))
        model._bmt_first_forward = first
        attach_verify(model)
        attach_generate(model)  # transformers models: ranks stop together, parameters gathered once
        for note in plan.notes:
            get_logger().debug("plan: %s", note)
        return model


def _plan_on_rank0(model: nn.Module, discovery: passes.Discovery, example_inputs: Any,
                   mixed_precision: MixedPrecision | None, options: dict[str, Any], shard_size: int,
                   tp: TensorParallelPlan | None, fused_loss: bool, pipeline: tuple[int, int, int] | None,
                   experts: ExpertPlan | None = None) -> WrapPlan:
    """Capture and plan (rank 0 only; the others receive its plan), for shards over ``shard_size`` ranks;
    ``pipeline``: (ranks, micro-batches, stages per rank) to cut it into; ``experts``: the expert-parallel
    section."""
    cap = passes.capture(model, discovery, example_inputs)
    passes.check_captured_reads(model, tp, cap.readers)
    section = passes.fused_loss_section(model, cap, enabled=fused_loss, tensor_parallel=tp)
    plan = passes.build_plan(model, discovery, world_size=shard_size, capture=passes.with_fused_loss(cap, section),
                             mixed_precision=mixed_precision, tensor_parallel=tp, experts=experts, **options)
    if pipeline is not None:
        size, micros, virtual = pipeline
        plan.pipeline = passes.plan_pipeline(model, plan, size, micros, cap.graph if cap.method != "none" else None,
                                             virtual=virtual, activations=cap.activations)
    return plan


wrap = BMTrainModelWrapper


def _budget_needs_activations(plan: WrapPlan, world_size: int) -> bool:
    """True when a memory budget was given but the plan could not weigh activations (no inputs yet): the
    first forward's inputs then decide what the budget keeps."""
    est = plan.estimates.get(str(world_size))
    return plan.memory_budget is not None and (est is None or est.activations is None)


def _warn_if_no_blocks(model: nn.Module, plan: WrapPlan, discovery: passes.Discovery) -> None:
    """Warn when discovery left a model that has children as one root group (nothing checkpointed or
    prefetched); a single layer (BMTrain code wraps ``nn.Linear``s) has nothing to find."""
    if plan.blocks() or next(model.children(), None) is None:
        return
    why = "; ".join(n for n in discovery.notes if "no repeated blocks" not in n)
    warnings.warn(
        f"BMTrainModelWrapper found no repeated blocks in {type(model).__name__}: all its parameters form one "
        "root group that every forward gathers whole, so nothing is checkpointed or prefetched and each rank's "
        "peak memory holds every parameter."
        f"{f' Discovery: {why}.' if why else ''} Blocks are sibling modules of one structure, each with its own "
        "forward and at least 0.5% of the parameters. To compile layers, wrap first and then call "
        "`layer.compile()` on each (docs/compile.md); to choose blocks yourself, pass plan= (bmt-wrap dump "
        "--format json writes one to edit).", UserWarning, stacklevel=3)


def _warn_if_budget_inexact() -> None:
    """Warn when a budget spent on host memory counts tensors the allocator does not give back."""
    if counts_exactly():
        return
    given = os.environ.get(THRESHOLD_VAR)
    setting = f"{THRESHOLD_VAR}={given}" if given is not None else "glibc's default allocator"
    warnings.warn(
        f"memory_budget= is spent by counting tensors, and under {setting} this CPU process "
        "holds more than its tensors (its heap keeps what they free, or small ones take whole pages), so "
        "resident memory can pass the "
        f"budget. Start the job with {EXACT_SETTING} in its environment (freed tensors then leave the process; "
        "it costs some step time: docs/design.md \"Capacity\"), or pass a budget with headroom.",
        UserWarning, stacklevel=3)


def _refuse_sharded_parts(model: nn.Module) -> None:
    """Raise, on every rank alike and before any collective, if ``model`` already holds sharded parts.

    The passes plan plain parameters: tracing a ``CheckpointBlock`` would run its gather on rank 0 alone
    (a hang), and its 1-D shards would be planned as if they were whole parameters.
    """
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DistributedParameter)]
    if sharded:
        blocks = [n for n, m in model.named_modules() if isinstance(m, CheckpointBlock)]
        raise WrapError(
            f"{type(model).__name__} already holds sharded parts ({', '.join(blocks[:3] or sharded[:3])}"
            f"{' ...' if len(blocks or sharded) > 3 else ''}): BMTrainModelWrapper shards a plain model. Either "
            "wrap the plain model (it finds the blocks itself; a layer called twice is shared), or finish the "
            "explicit API: make the root a bmt.DistributedModule whose own parameters are "
            "bmt.DistributedParameters.")
