"""Capture: the block call order of one forward, by the cheapest method that works.

1. ``fx``: ``torch.fx`` symbolic trace with discovered blocks as leaves (no inputs needed, milliseconds);
2. ``export``: ``torch.export`` (non-strict) of a meta copy on meta copies of example inputs;
3. ``eager``: forward-pre-hooks while a meta copy runs on meta inputs;
4. ``none``: module order assumed. The caller then records a real first call with ``EagerRecorder``.

A failing method never raises: the next one is tried and the reason is kept in ``Capture.notes``.
Nothing here runs real compute or allocates real storage.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..base._compat import drop_compiled_call, pytree
from ..base.fused_loss_plan import FusedLossPlan
from ..base.plan import EXPORT_FAILED_NOTE, FX_FAILED_NOTE
from .activations import ActivationProfile
from .discover import Discovery
from .export_graph import ExportResult, export_blocks
from .recorder import EagerRecorder
from .util import describe, self_checkpointing_suspended

CAPTURE_METHODS = ("fx", "export", "eager", "none")

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Capture:
    """How the block order was obtained, the order itself, and a block-level graph of one forward."""

    method: str  # one of CAPTURE_METHODS
    order: list[str]  # canonical block FQN per block call, in call order (a shared block repeats)
    graph: fx.Graph  # one ``call_module`` node per block call; display and schedule source, never run
    notes: list[str] = field(default_factory=list)
    activations: ActivationProfile | None = None  # needs example inputs
    fused_loss: FusedLossPlan | None = None  # the vocabulary head and its loss found in the graph (with_fused_loss)
    readers: dict[str, list[str]] | None = None  # export's parameter -> the modules reading it (none without)


def as_call(example_inputs: object) -> Call | None:
    """Normalise example inputs: a tensor, a tuple of args, a dict of kwargs, or ``(args, kwargs)``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[0], tuple)
            and isinstance(example_inputs[1], dict)):
        return example_inputs[0], dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def token_count(call: Call | None) -> int | None:
    """One rank's tokens per step: the first integer input's (the token ids') batch x sequence; None without."""
    ids = [x for x in pytree.tree_leaves(call) if isinstance(x, torch.Tensor) and not x.is_floating_point()]
    return ids[0].numel() if ids else None


def to_meta(tree: Any) -> Any:
    """Copy every tensor in a pytree to the meta device (shape, dtype and strides only).

    A leaf that is an object holding tensors (generate's KV cache, a transformers ``DynamicCache``) is
    copied with its tensors on meta: a meta run updates it in place, and the caller's must stay as it was
    for the real call that follows.
    """
    return pytree.tree_map(_meta_leaf, tree)


_PLAIN_LEAVES = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _meta_tensor(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _meta_leaf(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _meta_tensor(leaf)
    if isinstance(leaf, _PLAIN_LEAVES) or callable(leaf):
        return leaf
    memo: dict[int, Any] = {id(t): _meta_tensor(t) for t in _tensors_held(leaf, set())}
    return copy.deepcopy(leaf, memo)


def _tensors_held(obj: Any, seen: set[int]) -> list[torch.Tensor]:
    """The tensors reachable from ``obj`` through its attributes and containers."""
    if id(obj) in seen or isinstance(obj, _PLAIN_LEAVES):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [t for child in children for t in _tensors_held(child, seen)]


def _is_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are on the meta device.

    Costs module objects only. Keep one before sharding a model to capture it later (first forward).
    """
    if _is_meta(model):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(model, memo)
    # Plain tensor attributes (caches, constants) would meet meta inputs on another device. A copied
    # torch.compile(m) wrapper compiles again, and export then records no call of m: call m eagerly.
    for module in skeleton.modules():
        drop_compiled_call(module)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                setattr(module, name, torch.empty_like(value, device="meta"))
    return skeleton


class _BlockTracer(fx.Tracer):
    """fx tracer that keeps discovered blocks as opaque leaves (their inside is never traced)."""

    def __init__(self, block_names: set[str]) -> None:
        super().__init__()
        self.block_names = block_names

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Blocks are leaves, as are torch's own layers."""
        return module_qualified_name in self.block_names or super().is_leaf_module(m, module_qualified_name)


def _fx_capture(model: nn.Module, discovery: Discovery) -> tuple[fx.Graph, list[str]]:
    canonical = discovery.canonical
    graph = _BlockTracer(set(canonical)).trace(model)
    order = [canonical[str(n.target)] for n in graph.nodes if n.op == "call_module" and n.target in canonical]
    return graph, order


def chain_graph(order: list[str]) -> fx.Graph:
    """A graph that calls the blocks in ``order``, each on the previous one's output (data flow unknown)."""
    graph = fx.Graph()
    value = graph.placeholder("inputs")
    for fqn in order:
        value = graph.call_module(fqn, (value,))
    graph.output(value)
    return graph


def eager_capture(recorder: EagerRecorder, notes: list[str] | None = None) -> Capture:
    """The capture of a call recorded by ``recorder`` (``with EagerRecorder(model, d) as r: model(...)``)."""
    return Capture("eager", list(recorder.order), chain_graph(recorder.order), list(notes or []))


def capture(model: nn.Module, discovery: Discovery, example_inputs: object = None) -> Capture:
    """Capture the block order of ``model`` (real or meta) by the cheapest method that works.

    The caller's random streams are left as they were: a traced forward that draws on the CPU generator
    (layer-drop's ``torch.rand([])`` makes a real CPU tensor even in a meta run) would otherwise shift every
    dropout mask of the first real step.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), self_checkpointing_suspended(model):
        return _capture(model, discovery, example_inputs)


def _capture(model: nn.Module, discovery: Discovery, example_inputs: object) -> Capture:
    notes: list[str] = []
    fx_result: tuple[fx.Graph, list[str]] | None = None
    try:
        fx_result = _fx_capture(model, discovery)
    except Exception as exc:  # any tracing failure means "try the next method"
        notes.append(f"{FX_FAILED_NOTE} ({describe(exc)})")

    call = as_call(example_inputs)
    exported: ExportResult | None = None
    skeleton: nn.Module | None = None
    if call is not None:
        try:
            skeleton = meta_skeleton(model)
        except Exception as exc:  # e.g. an attribute deepcopy cannot copy
            notes.append(f"no meta copy of the model ({describe(exc)}): export and meta run skipped")
    if call is not None and skeleton is not None:
        try:
            exported = export_blocks(skeleton, discovery, *to_meta(call))
            notes += exported.notes
        except Exception as exc:
            notes.append(f"{EXPORT_FAILED_NOTE} ({describe(exc)})")
    activations = exported.activations if exported is not None else None
    if activations is not None:
        activations.tokens = token_count(call)
    if call is None:
        notes.append("activation bytes unknown: no example inputs")
    elif exported is None:
        notes.append("activation bytes unknown: they are measured on the exported graph")

    readers = exported.readers if exported is not None else None
    if fx_result is not None:
        return Capture("fx", fx_result[1], fx_result[0], notes, activations, readers=readers)
    if exported is not None:
        return Capture("export", exported.order, exported.graph, notes, activations, readers=readers)
    if call is not None and skeleton is not None:
        try:
            args, kwargs = to_meta(call)
            with EagerRecorder(skeleton, discovery) as recorder, torch.no_grad():
                skeleton(*args, **kwargs)
            return eager_capture(recorder, notes + ["block order recorded on a meta run"])
        except Exception as exc:
            notes.append(f"meta run failed ({describe(exc)})")
    notes.append("block order assumed to be module order: record the first real call with EagerRecorder"
                 if call is not None else
                 "block order assumed to be module order until inputs are known (example_inputs= or first call)")
    return Capture("none", discovery.fqns(), chain_graph(discovery.fqns()), notes, activations)
