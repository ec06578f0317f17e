"""Sequence parallelism for the one-liner: where norms, dropout and residual adds can run on each TP rank's
part of the sequence (pure, one process, no communication).

Megatron-SP and BMTrain keep the hidden states cut along the sequence between the parallel Linears: the
all-reduce after a row Linear becomes a reduce-scatter along the sequence, and the input of the next
column Linear is all-gathered. That is only the same function when everything run on a sequence part is
token-wise, so this pass proves it on each block's fx graph (the block's own forward, with the modules
holding a column -> row pair, norms, dropouts and Linears as leaves), following the block's hidden-states
input (its first argument, dimension ``dim`` the sequence) through the graph:

- into a *unit* (a module holding column Linears and the row Linear they feed, and no other parameter: an
  attention, an MLP): the unit gathers that argument whole on entry and its row Linear reduce-scatters, so
  the unit's own code (reshapes into heads, attention over every token) sees the whole sequence (whether
  the gather's backward may sum the columns' partial gradients is ``_columns_only``'s question);
- into a column Linear of the block itself, whose pair is elementwise (``derive_pairs``' kind): it gathers
  its own input;
- through token-wise ops only otherwise: norms over the last dimension, dropout, Linears left whole, and
  elementwise ops whose other operands are parameters or constants, never a tensor the block got whole.

A unit's inside need not trace (transformers' attentions do not); its split is the TP plan's (the model's
own or ``tp_plan=``), whose reshapes TP already relies on. The blocks are then chained through
the root's fx graph where it traces (a block's output feeding only the next block's input stays cut; after
the last block, token-wise root modules run cut up to the head, which gathers); where it does not, each
block cuts its input on entry and gathers its output on exit, until the first forward's exported graph
chains them (``chain_from_capture``). What cannot be proven is listed in
``SequenceParallel.reasons`` and runs as plain TP.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..base.tp_plan import SequenceParallel, SPPoint, TensorParallelPlan, TPEntry
from ..errors import listed
from .discover import Discovery
from .tensor_parallel import linear_kind

SEQUENCE_DIM = 1  # hidden states are (batch, sequence, features), as transformers' and the toy models'
_TOKEN_WISE_FUNCS = {F.gelu, F.silu, F.relu, F.tanh, F.sigmoid, torch.tanh, torch.sigmoid, torch.relu,
                     operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
                     torch.mul, torch.add, torch.sub, torch.div, torch.pow}
_TOKEN_WISE_METHODS = {"mul", "add", "sub", "div", "pow", "relu", "sigmoid", "tanh", "contiguous", "float",
                       "to", "type_as"}
_ELEMENTWISE_MODULES = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_NOT_CHAINED = "blocks not chained"
_SPLIT, _TP, _WHOLE = "split", "tp", "whole"  # a value cut along the sequence; between a pair; anything else


class _NotSafe(Exception):
    """Why a block (or the chain) cannot run on sequence parts."""


def token_wise(module: nn.Module) -> bool:
    """True for a module that computes each token from that token alone: a norm over the last dimension,
    ``nn.Dropout``, an elementwise activation, a Linear."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return len(module.normalized_shape) == 1
    if type(module) is nn.Dropout or isinstance(module, _ELEMENTWISE_MODULES) or linear_kind(module):
        return True
    # transformers' norms (LlamaRMSNorm, T5LayerNorm ...): matched by name, as Conv1D is, with 1-D weights only
    name = type(module).__name__
    params = list(module.parameters(recurse=False))
    return (name.endswith(("RMSNorm", "LayerNorm")) and not list(module.children())
            and all(p.dim() == 1 for p in params))


def plan_sequence_parallel(model: nn.Module, tp: TensorParallelPlan, discovery: Discovery) -> SequenceParallel:
    """The sequence-parallel section for ``model`` split per ``tp``: on for every block proven token-wise
    outside its parallel pairs, with the reason for each block (and chain link) that is not."""
    sp = SequenceParallel(enabled=False, dim=SEQUENCE_DIM)
    entries = {e.module: e for e in tp.entries}
    for block in discovery.blocks:
        try:
            _plan_block(model, block.fqn, entries, sp)
        except _NotSafe as why:
            sp.reasons.append(f"block {block.fqn}: {why}")
    if any(p.kind == "enter" for p in sp.points):
        try:
            _chain(model, discovery, entries, sp)
        except _NotSafe as why:
            sp.reasons.append(f"{_NOT_CHAINED}, each gathers its output ({why})")
    sp.enabled = any(p.kind == "row" for p in sp.points)
    if not sp.enabled and not sp.reasons:
        sp.reasons.append("no block holds a column -> row pair of the TP plan")
    sp.partial, sp.dropouts = sorted(set(sp.partial)), sorted(set(sp.dropouts))
    return sp


# ---- one block ------------------------------------------------------------------------------------------
def _plan_block(model: nn.Module, fqn: str, entries: dict[str, TPEntry], sp: SequenceParallel) -> None:
    block = model.get_submodule(fqn)
    inside = {n[len(fqn) + 1:]: e for n, e in entries.items() if n.startswith(f"{fqn}.")}
    rows = {n: e for n, e in inside.items() if e.style == "rowwise"}
    if not rows:
        return  # no pair here: the block runs whole, as under plain TP
    odd = sorted(n for n, e in inside.items() if e.style not in ("colwise", "rowwise"))
    if odd:
        raise _NotSafe(f"{listed(odd)} split with styles other than colwise/rowwise")
    widths = {e.out_features for e in rows.values()}
    if len(widths) != 1:
        raise _NotSafe(f"its row Linears give different widths {sorted(widths)}")
    width = widths.pop()
    units = {_parent(r) for r in rows if _parent(r)}
    for unit in units:
        _check_unit(block, unit, inside)
    graph = _trace(block, lambda m, q: q in units or token_wise(m))
    walk = _Walk(block, fqn, units, inside)
    walk.run(graph)
    direct: set[str] = set()  # units whose columns read the gathered hidden states and nothing else does
    for unit in sorted(units):
        first = next(e for n, e in inside.items() if _parent(n) == unit and e.style == "colwise")
        sole = _columns_only(block.get_submodule(unit), {n.rpartition(".")[2] for n in inside if _parent(n) == unit})
        direct |= {unit} if sole else set()
        sp.points.append(SPPoint(f"{fqn}.{unit}", "unit" if sole else "unit_whole", first.in_features, fqn,
                                 walk.unit_args[unit]))
    for name, e in sorted(inside.items()):
        if e.style == "colwise" and _parent(name) in units and _parent(name) not in direct:
            continue  # a plain column Linear of a unit_whole: its copy's all-reduce stays
        kind = ("row" if e.style == "rowwise" else "column" if _parent(name) in units else "gather")
        sp.points.append(SPPoint(e.module, kind, e.out_features if kind == "row" else e.in_features, fqn))
        if kind == "row" and "bias" in e.full_shapes:  # added after the reduce-scatter: to sequence parts
            sp.partial.append(f"{e.module}.bias")
    sp.points += [SPPoint(fqn, "enter", width, fqn), SPPoint(fqn, "leave", width, fqn)]
    sp.partial += walk.partial
    sp.dropouts += walk.dropouts


def _check_unit(block: nn.Module, unit: str, inside: dict[str, TPEntry]) -> None:
    """A unit gathers its input whole, so every parameter in it must belong to its split Linears (anything
    else would run whole on every rank with a gradient summed as a part) and no dropout may run on its
    row's cut output unseen."""
    module = block.get_submodule(unit)
    split = {f"{unit}.{n}" for n, _ in module.named_modules() if n and f"{unit}.{n}" in inside}
    if not any(inside[n].style == "colwise" for n in split):
        raise _NotSafe(f"{unit} holds a row Linear but no column Linear feeding it")
    other = [f"{unit}.{n}" for n, _ in module.named_parameters()
             if f"{unit}.{n}".rpartition(".")[0] not in split]
    if other:
        raise _NotSafe(f"{unit} holds parameters outside its split Linears ({listed(other)})")
    drops = [f"{unit}.{n}" for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if drops:
        raise _NotSafe(f"{unit} holds dropout {listed(drops)}, which may run on its row Linear's cut output")


def _columns_only(unit: nn.Module, linears: set[str]) -> bool:
    """True when ``unit``'s forward takes one argument and its graph uses it only as the input of its
    column Linears (and for its shape): the gather's backward may then sum the columns' partial input
    gradients (one reduce-scatter, Megatron's form). A forward with more parameters could branch on them
    (fx would bake the branch), and an untraceable one is unseen: such a unit gathers with a backward that
    keeps this rank's slice, its columns keeping their all-reduce ("unit_whole"), right whatever its code."""
    params = list(inspect.signature(inspect.unwrap(type(unit).forward)).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return False
    try:
        graph = _trace(unit, lambda m, q: linear_kind(m) is not None)
    except _NotSafe:
        return False
    hidden = next(n for n in graph.nodes if n.op == "placeholder")
    reads_shape = {"size", "dim"}
    for user in hidden.users:
        column = user.op == "call_module" and user.target in linears and user.args == (hidden,)
        shape = (user.op == "call_function" and user.target is getattr and user.args[1:] == ("shape",)) or (
            user.op == "call_method" and user.target in reads_shape)
        if not (column or shape):
            return False
    return True


class _Walk:
    """Follows the hidden states (cut along the sequence) through one block's graph."""

    def __init__(self, block: nn.Module, fqn: str, units: set[str], inside: dict[str, TPEntry]) -> None:
        self.block, self.fqn, self.units, self.inside = block, fqn, units, inside
        self.state: dict[fx.Node, str] = {}
        self.unit_args: dict[str, int | str] = {}
        self.partial: list[str] = []
        self.dropouts: list[str] = []
        self.on_parts: set[str] = set()  # modules called on a sequence part
        self.on_whole: set[str] = set()  # modules called on whole tensors only

    def run(self, graph: fx.Graph) -> None:
        """Raise ``_NotSafe`` naming the first op that would see a sequence part it cannot."""
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if not placeholders:
            raise _NotSafe("its forward takes no input")
        for node in graph.nodes:
            if node.op == "placeholder":
                self.state[node] = _SPLIT if node is placeholders[0] else _WHOLE
            elif node.op == "get_attr":
                self.state[node] = "param"
            elif node.op == "output":
                self._output(node)
            else:
                self.state[node] = self._step(node)
        both = sorted(self.on_parts & self.on_whole)
        if both:  # its parameters' gradients would be part sums and whole ones at once; a dropout, two streams
            raise _NotSafe(f"{listed(both)} runs both on sequence parts and on whole tensors")
        missing = self.units - set(self.unit_args)
        if missing:
            raise _NotSafe(f"{listed(sorted(missing))} never gets the block's hidden states")

    def _states(self, node: fx.Node) -> list[tuple[Any, str]]:
        """(where, state) of each node argument of ``node``: position or keyword."""
        found = [(i, self.state[a]) for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
        found += [(k, self.state[a]) for k, a in node.kwargs.items() if isinstance(a, fx.Node)]
        nested = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (tuple, list, dict))]
        for a in nested:
            for leaf in _nodes_in(a):
                if self.state[leaf] in (_SPLIT, _TP):
                    raise _NotSafe(f"{self._where(node)} gets a sequence part inside a container")
        return found

    def _step(self, node: fx.Node) -> str:
        if node.target is operator.getitem and self.state.get(node.args[0]) == "unit_out":
            return _SPLIT if node.args[1] == 0 else _WHOLE  # (hidden states, attention weights ...)
        # A unit returning a tensor returns its hidden states.
        states = [(w, _SPLIT if s == "unit_out" else s) for w, s in self._states(node)]
        kinds = {s for _, s in states}
        if not kinds & {_SPLIT, _TP}:
            if node.op == "call_module":
                self.on_whole.add(f"{self.fqn}.{node.target}")
            return _WHOLE
        if node.op == "call_module":
            return self._module(node, states)
        elementwise = (node.op == "call_function" and node.target in _TOKEN_WISE_FUNCS) or (
            node.op == "call_method" and node.target in _TOKEN_WISE_METHODS)
        if not elementwise:
            raise _NotSafe(f"{self._where(node)} is not token-wise and would get a sequence part")
        if _WHOLE in kinds or {_SPLIT, _TP} <= kinds:
            raise _NotSafe(f"{self._where(node)} mixes a sequence part with a tensor the block gets whole")
        self.partial += [f"{self.fqn}.{a.target}" for a in _nodes_in((node.args, node.kwargs))
                         if a.op == "get_attr"]
        return _SPLIT if _SPLIT in kinds else _TP

    def _module(self, node: fx.Node, states: list[tuple[Any, str]]) -> str:
        target, module = node.target, self.block.get_submodule(node.target)
        cut = [(where, s) for where, s in states if s in (_SPLIT, _TP)]
        where, state = cut[0]
        if len(cut) > 1:
            raise _NotSafe(f"{self._where(node)} gets more than one sequence part")
        entry = self.inside.get(target)
        if target in self.units and state == _SPLIT:
            if target in self.unit_args:
                raise _NotSafe(f"{target} is called more than once")
            self.unit_args[target] = where
            return "unit_out"
        if entry is not None and entry.style == "colwise" and state == _SPLIT:
            return _TP
        if entry is not None and entry.style == "rowwise" and state == _TP:
            return _SPLIT
        if state == _TP:
            if isinstance(module, _ELEMENTWISE_MODULES) or (type(module) is nn.Dropout and module.p == 0):
                return _TP
            raise _NotSafe(f"{target} ({type(module).__name__}) sits between a column and a row Linear")
        if entry is None and token_wise(module):
            self.on_parts.add(f"{self.fqn}.{target}")
            self.partial += [f"{self.fqn}.{target}.{n}" for n, _ in module.named_parameters()]
            if type(module) is nn.Dropout and module.p > 0:
                self.dropouts.append(f"{self.fqn}.{target}")
            return _SPLIT
        raise _NotSafe(f"{target} ({type(module).__name__}) is not token-wise and gets a sequence part")

    def _where(self, node: fx.Node) -> str:
        """``node`` for people: the op, and the module whose code runs it."""
        if node.op == "call_module":
            what = f"{self.fqn}.{node.target} ({type(self.block.get_submodule(node.target)).__name__})"
        else:
            args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
            what = f"{'.' if node.op == 'call_method' else ''}{name}({args})"
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if stack and node.op != "call_module":
            inner, cls = stack[-1]
            cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
            what += f" in {self.fqn}.{inner} ({cls_name.rpartition('.')[2]})"
        return what

    def _output(self, node: fx.Node) -> None:
        out = node.args[0]
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        rest = list(_nodes_in(out[1:])) if isinstance(out, (tuple, list)) else []
        if not isinstance(first, fx.Node) or self.state[first] not in (_SPLIT, "unit_out"):
            raise _NotSafe("its (first) output is not the hidden states it was given")
        if any(self.state[n] in (_SPLIT, _TP, "unit_out") for n in rest):
            raise _NotSafe("it returns a sequence part beside its hidden states")


def _nodes_in(value: Any) -> Iterator[fx.Node]:
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _nodes_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _nodes_in(v)


class _LeafTracer(fx.Tracer):
    def __init__(self, leaf: Any) -> None:
        super().__init__()
        self.leaf = leaf

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.leaf(m, module_qualified_name) or super().is_leaf_module(m, module_qualified_name)


def _trace(module: nn.Module, leaf: Any) -> fx.Graph:
    """``module``'s forward as an fx graph with ``leaf`` modules kept whole; raises ``_NotSafe``.

    transformers' forwards are wrapped by decorators taking ``*args, **kwargs`` and declare ``**kwargs``
    themselves, which fx cannot trace: the undecorated forward is traced through a stand-in whose
    forward names the same parameters (no ``**kwargs``, so they are empty), sharing the module's children.
    """
    forward = inspect.unwrap(type(module).forward)
    params = list(inspect.signature(forward).parameters.values())[1:]
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    target = module
    if forward is not type(module).forward or len(named) != len(params):
        src = (f"def forward(self, {', '.join(named)}):\n"
               f"    return _forward(self, {', '.join(f'{n}={n}' for n in named)})\n")
        scope: dict[str, Any] = {"_forward": forward}
        exec(src, scope)  # a function with exactly these parameters: what fx reads
        stand_in = type(type(module).__name__, (type(module),), {"forward": scope["forward"]})
        target = stand_in.__new__(stand_in)
        target.__dict__ = dict(module.__dict__)
    try:
        return _LeafTracer(leaf).trace(target)
    except Exception as exc:  # any: what fx cannot trace is not proven
        raise _NotSafe(f"fx cannot trace {type(module).__name__} ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None


# ---- between blocks -------------------------------------------------------------------------------------
def _chain(model: nn.Module, discovery: Discovery, entries: dict[str, TPEntry], sp: SequenceParallel) -> None:
    """Drop the gather/cut between consecutive sequence-parallel blocks, and carry the last block's cut
    output through token-wise root modules to the head, where the root's graph proves it."""
    blocks = set(discovery.fqns())
    graph = _trace(model, lambda m, q: q in blocks or token_wise(m))
    _link(graph, sp, lambda node: _tail(model, node, entries))


def _link(graph: fx.Graph, sp: SequenceParallel, tail: Any = None) -> None:
    """Drop the leave/enter pairs between blocks of ``graph`` (one call node per block) that feed each other
    directly; ``tail(node)``: the head point after block ``node``, or None."""
    cut = {p.module for p in sp.points if p.kind == "enter"}
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in cut]
    if len({n.target for n in calls}) != len(calls):
        raise _NotSafe("a block is called more than once per forward")
    drop: set[tuple[str, str]] = set()
    for node in calls:
        users = list(node.users)
        nxt = users[0] if len(users) == 1 else None
        if nxt is not None and nxt.op == "call_module" and nxt.target in cut and nxt.args[:1] == (node,):
            drop |= {(node.target, "leave"), (nxt.target, "enter")}
        elif tail is not None and (found := tail(node)) is not None:
            point, partial, dropouts = found
            drop.add((node.target, "leave"))
            sp.points.append(point)
            sp.partial += partial
            sp.dropouts += dropouts
    sp.points = [p for p in sp.points if (p.module, p.kind) not in drop]


def chain_from_capture(sp: SequenceParallel, graph: fx.Graph) -> SequenceParallel:
    """``sp`` with the cut and gather dropped between blocks that the first forward's exported graph (a
    ``call_module`` node per block call, with its real data flow) shows feeding each other directly: for
    models whose root fx cannot trace at wrap time. The last block still gathers its output (carrying it
    to the head would change which parameters get part gradients, fixed at wrap time)."""
    if not sp.enabled or not any(r.startswith(_NOT_CHAINED) for r in sp.reasons):
        return sp
    out = copy.deepcopy(sp)
    try:
        _link(graph, out)
    except _NotSafe as why:
        out.reasons.append(f"the first forward's graph does not chain the blocks either ({why})")
        return out
    if len(out.points) < len(sp.points):
        out.reasons = [r for r in out.reasons if not r.startswith(_NOT_CHAINED)]
        out.reasons.append("blocks chained from the first forward's exported graph (the root's fx trace "
                           "failed at wrap time); the last block gathers its output")
    return out


def _tail(model: nn.Module, node: fx.Node, entries: dict[str, TPEntry]
          ) -> tuple[SPPoint, list[str], list[str]] | None:
    """The head point after the last block's ``node``, with the token-wise root modules' parameters and
    dropouts on the way, or None (the block gathers its output)."""
    partial: list[str] = []
    dropouts: list[str] = []
    while len(node.users) == 1:
        prev, node = node, next(iter(node.users))
        if node.op != "call_module" or node.args != (prev,) or node.kwargs:
            return None
        module = model.get_submodule(node.target)
        entry = entries.get(node.target)
        if linear_kind(module):
            if entry is None:
                return SPPoint(node.target, "head_whole", _in_features(module)), partial, dropouts
            if entry.style == "colwise_gather":
                return SPPoint(node.target, "head", entry.in_features), partial, dropouts
            return None
        if entry is not None or not token_wise(module) or sum(
                n.op == "call_module" and n.target == node.target for n in node.graph.nodes) > 1:
            return None  # also called elsewhere: on whole tensors there
        partial += [f"{node.target}.{n}" for n, _ in module.named_parameters()]
        if type(module) is nn.Dropout and module.p > 0:
            dropouts.append(node.target)
    return None


def _in_features(module: nn.Module) -> int:
    return module.weight.shape[0 if linear_kind(module) == "conv1d" else 1]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]
