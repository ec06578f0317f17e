"""The pure compiler passes: discover -> capture -> plan -> estimate, and the schedule drawn for ``dump``
(no communication, no real storage)."""

from ..base.plan import render_estimates
from .activations import ActivationProfile, BlockCallActivations
from .capture import (
    CAPTURE_METHODS,
    Capture,
    as_call,
    capture,
    chain_graph,
    eager_capture,
    meta_skeleton,
    to_meta,
)
from .context_parallel import local_call, plan_context_parallel, with_sequence
from .discover import BlockList, DiscoveredBlock, Discovery, discover_blocks
from .estimate import estimate, estimate_mesh, estimate_tp
from .experts import check_tp_split, plan_experts
from .fused_loss import fuse_loss, fused_loss_section, with_fused_loss
from .pipeline import check_root_order, plan_pipeline
from .planner import build_plan, place_parameters, schedule
from .recorder import EagerRecorder
from .render import render_dot, render_json, render_text
from .schedule_graph import Step, schedule_graph, steps
from .sequence_parallel import chain_from_capture, plan_sequence_parallel
from .tensor_parallel import plan_tensor_parallel
from .tp_uses import check_captured_reads, refuse_outside_reads
from .util import self_checkpointing_modules

__all__ = [
    "CAPTURE_METHODS", "ActivationProfile", "BlockCallActivations", "BlockList", "Capture", "DiscoveredBlock",
    "Discovery", "EagerRecorder", "Step", "as_call", "build_plan", "capture", "chain_from_capture", "chain_graph",
    "check_captured_reads", "check_tp_split", "check_root_order", "plan_experts", "plan_pipeline",
    "discover_blocks", "eager_capture", "local_call", "plan_context_parallel", "with_sequence", "estimate", "estimate_mesh", "estimate_tp", "fuse_loss",
    "fused_loss_section", "meta_skeleton",
    "place_parameters", "plan_sequence_parallel", "plan_tensor_parallel", "refuse_outside_reads", "render_dot",
    "render_estimates", "render_json", "render_text", "schedule", "schedule_graph",
    "self_checkpointing_modules", "steps", "to_meta", "with_fused_loss",
]

# The names before issue 23, for callers that import them: ``rewrite`` never rewrote the model (apply_plan
# does), and ``Block`` read like ``bmt.Block`` (= ``CheckpointBlock``).
Block = DiscoveredBlock
rewrite = schedule_graph
