"""The pure compiler passes: discover -> capture -> plan -> rewrite (no communication, no real storage)."""

from ..plan import render_estimates
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
from .discover import Block, BlockList, Discovery, discover_blocks
from .estimate import estimate, estimate_mesh
from .planner import build_plan, place_parameters, schedule
from .recorder import EagerRecorder
from .render import render_dot, render_json, render_text
from .rewrite import Step, rewrite, steps
from .util import self_checkpointing_modules

__all__ = [
    "CAPTURE_METHODS", "ActivationProfile", "Block", "BlockCallActivations", "BlockList", "Capture", "Discovery",
    "EagerRecorder", "Step", "as_call", "build_plan", "capture", "chain_graph", "discover_blocks",
    "eager_capture", "estimate", "estimate_mesh", "meta_skeleton", "place_parameters", "render_dot", "render_estimates",
    "render_json", "render_text", "rewrite", "schedule", "self_checkpointing_modules", "steps", "to_meta",
]
