"""torch.export capture: export a meta copy of the model, condense its ATen graph to one node per block call.

Block calls are read from each node's ``nn_module_stack``; repeated calls of one module get distinct
stack keys (``...@1``), so a shared layer called twice yields two calls.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..base._compat import forget_export_trace, masks_as_eager, no_stack_traces, pytree, reorder_kwargs
from ..errors import PlanError
from .activations import ActivationProfile, BlockKey, profile_activations
from .discover import Discovery
from .util import describe

_INNER = "inner"  # attribute under which _TensorOutputs holds the model


class _TensorOutputs(nn.Module):
    """Exports need pytree outputs; keeping only the output tensors drops objects such as a KV cache."""

    def __init__(self, inner: nn.Module, report: Callable[[int], object] = lambda nbytes: None) -> None:
        super().__init__()
        setattr(self, _INNER, inner)
        # Told the bytes the output's objects hold. A callable, not a dict on the module: export restores
        # the module's own state after tracing.
        self.report = report

    def forward(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        """The wrapped model's output tensors, flattened."""
        out = getattr(self, _INNER)(*args, **kwargs)
        leaves = pytree.tree_leaves(out)
        self.report(_bytes_held_by(x for x in leaves if not isinstance(x, torch.Tensor)))
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))


def _bytes_held_by(objects: Iterable[object], depth: int = 6) -> int:
    """Bytes of the distinct tensors reachable from ``objects`` through their attributes and containers
    (a KV cache's keys and values), ``depth`` levels deep."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    frontier = list(objects)
    for _ in range(depth):
        nxt: list[object] = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                base = obj if obj._base is None else obj._base
                found[id(base)] = base.untyped_storage().nbytes()
            elif isinstance(obj, dict):
                nxt += obj.values()
            elif isinstance(obj, (list, tuple, set)):
                nxt += obj
            elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
                nxt += vars(obj).values()
        frontier = nxt
    return sum(found.values())


def unwrapped_name(path: str) -> str:
    """A module or parameter name of the exported wrapper, as the model itself names it."""
    return "" if path == _INNER else path.removeprefix(_INNER + ".")


def block_resolver(discovery: Discovery) -> Callable[[fx.Node], BlockKey | None]:
    """A function giving the block call an exported node belongs to (None for root nodes)."""
    canonical = discovery.canonical

    def block_of(node: fx.Node) -> BlockKey | None:
        keys: list[str] = []
        for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
            keys.append(key)
            fqn = canonical.get(unwrapped_name(path))
            if fqn is not None:
                return fqn, tuple(keys)
        return None

    return block_of


def condense(graph: fx.Graph, block_of: Callable[[fx.Node], BlockKey | None]) -> tuple[fx.Graph, list[str]]:
    """Replace each block call's run of ATen nodes by one ``call_module`` node; return graph and call order."""
    nodes = list(graph.nodes)
    keys = [block_of(n) for n in nodes]
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    order: list[str] = []
    done: set[BlockKey] = set()

    def value(n: fx.Node) -> fx.Node:
        # Root parameters appear as get_attr nodes only where root code uses them.
        if n not in env and n.op == "get_attr":
            env[n] = out.get_attr(unwrapped_name(str(n.target)))
        return env[n]

    i = 0
    while i < len(nodes):
        n, key = nodes[i], keys[i]
        if key is None:
            if n.op == "output":
                out.output(fx.map_arg(n.args[0], value))
            elif n.op != "get_attr":
                env[n] = out.node_copy(n, value)
            i += 1
            continue
        if key in done:
            raise PlanError(f"block {key[0]!r} runs root code in the middle of its call; its order cannot be "
                            "read from the exported graph")
        j = i
        while j < len(nodes) and keys[j] == key:
            j += 1
        segment = nodes[i:j]
        inside = set(segment)
        entering = list(dict.fromkeys(a for m in segment for a in m.all_input_nodes
                                      if a not in inside and a.op != "get_attr"))
        leaving = [m for m in segment if any(u not in inside for u in m.users)]
        call = out.call_module(key[0], tuple(value(a) for a in entering))
        call.meta["aten_ops"] = len(segment)
        if len(leaving) == 1:
            env[leaving[0]] = call
        else:
            for k, m in enumerate(leaving):
                env[m] = out.call_function(operator.getitem, (call, k))
        order.append(key[0])
        done.add(key)
        i = j
    return out, order


@dataclass
class ExportResult:
    """What one torch.export of the model yields."""

    graph: fx.Graph
    order: list[str]
    activations: ActivationProfile | None
    notes: list[str] = field(default_factory=list)
    readers: dict[str, list[str]] = field(default_factory=dict)  # parameter_readers of the whole graph


def parameter_readers(graph: fx.Graph) -> dict[str, list[str]]:
    """Parameter (or buffer) name -> the modules whose own code computes with it: the innermost module of
    each reading node's ``nn_module_stack`` ("" for the root's code)."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            stacks = [list((u.meta.get("nn_module_stack") or {}).values()) for u in node.users]
            readers[unwrapped_name(str(node.target))] = sorted({unwrapped_name(s[-1][0]) if s else "" for s in stacks})
    return readers


def export_blocks(skeleton: nn.Module, discovery: Discovery, args: tuple, kwargs: dict) -> ExportResult:
    """Export ``skeleton`` (meta parameters) on meta inputs; block order, graph and activation bytes."""
    object_bytes: list[int] = []
    try:
        with no_stack_traces(), masks_as_eager():
            ep = torch.export.export(_TensorOutputs(skeleton, object_bytes.append), args, kwargs, strict=False)
    finally:
        forget_export_trace()
    gm = ep.module(check_guards=False)
    block_of = block_resolver(discovery)
    graph, order = condense(gm.graph, block_of)
    notes: list[str] = []
    try:
        flat = pytree.tree_leaves((args, reorder_kwargs(kwargs, ep.call_spec.in_spec)))
        activations: ActivationProfile | None = profile_activations(gm, flat, block_of)
        activations.object_bytes = object_bytes[-1] if object_bytes else 0
    except Exception as exc:  # the estimate is optional: the capture stands without it
        activations = None
        notes.append(f"activation bytes unknown: measuring them on the exported graph failed ({describe(exc)})")
    return ExportResult(graph, order, activations, notes, parameter_readers(gm.graph))

