"""Reads of a split parameter outside the module whose forward a TP style replaces (pure, one process).

A style replaces one module's ``forward``; the parameter it splits then holds this TP rank's slice. Code
that reads the same Parameter elsewhere (the root's ``F.linear(h, self.embed.weight)``, OLMo's tied head,
``h @ self.wte.weight.t()``, the weight passed to another module) would see that slice alone: a wrong
answer without an error. Such code can only sit in an ancestor of the owning module (the attributes lead
there; a tie to another module is an alias, ``tensor_parallel._keep_tied_consistent``). Each ancestor's
own code is read from its fx graph (every submodule a leaf), or, where fx cannot trace it (transformers'
forwards), from its source: a ``.weight`` read that does not resolve to another module through
``self.a.b`` counts as a read of every split ``weight`` below it. What neither shows (a function given the
module reads its weight), a captured graph does: ``check_captured_reads`` refuses it at the first call.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx, nn

from ..base.tp_plan import TensorParallelPlan
from ..errors import TensorParallelPlanError, listed

# Reads of a parameter's metadata that are the same whole or split.
_METADATA = {"dtype", "device", "requires_grad", "is_cuda", "is_meta"}


class _OwnCodeTracer(fx.Tracer):
    """fx's tracer with every submodule a leaf: the graph is the traced module's own code only."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def outside_reads(model: nn.Module, tp: TensorParallelPlan) -> dict[str, str]:
    """Split module name -> the first read of one of its split parameters outside its replaced forward."""
    owners = _owners(model, tp)
    below: dict[str, dict[int, str]] = defaultdict(dict)  # ancestor -> split parameter id -> its name there
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners:
            parts = name.split(".")
            for i in range(len(parts) - 1):
                below[".".join(parts[:i])].setdefault(id(p), ".".join(parts[i:]))
    found: dict[str, str] = {}
    untraceable: set[type] = set()  # classes fx failed on: their other instances are read from source
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):  # a traced forward may draw (layer-drop's torch.rand([]))
        for where in sorted(below, key=lambda a: (a != "", a.count("."), a)):
            module = model.get_submodule(where)
            for pid, how in _reads(module, below[where], untraceable).items():
                label = f"{where}'s forward" if where else f"the root's forward ({type(module).__name__})"
                for owner in owners[pid]:
                    found.setdefault(owner, f"{label} reads {_full(where, below[where][pid])} itself ({how}), "
                                            "so split it would see this TP rank's slice only")
    return found


def _owners(model: nn.Module, tp: TensorParallelPlan) -> dict[int, list[str]]:
    """Split parameter id -> the modules whose entries split it (a tied weight: each alias's)."""
    owners: dict[int, list[str]] = defaultdict(list)
    for e in tp.entries:
        for n in e.split_dims:
            owners[id(model.get_parameter(f"{e.module}.{n}" if e.module else n))].append(e.module)
    return owners


def check_captured_reads(model: nn.Module, tp: TensorParallelPlan | None,
                         readers: dict[str, list[str]] | None) -> None:
    """Raise ``TensorParallelPlanError`` when a captured graph (``Capture.readers``: torch.export's, of the
    unsplit ``model``) shows a split parameter read by code other than the modules splitting it: what the
    pass could not see at wrap time (a forward fx cannot trace, reading it through a helper)."""
    if tp is None or not readers:
        return
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(name)
    bad = []
    for pid, mods in sorted(_owners(model, tp).items(), key=lambda kv: sorted(kv[1])):
        others = sorted({r for name in aliases[pid] for r in readers.get(name, []) if r not in mods})
        if others:
            where = listed([f"{r}'s forward" if r else "the root's forward" for r in others], fmt=str)
            bad.append(f"{aliases[pid][0]} (split by {listed(sorted(mods))}) is also read by {where}")
    if bad:
        raise TensorParallelPlanError(
            f"tensor parallelism split parameters that other code reads as well, which would see this TP rank's "
            f"slice only: {'; '.join(bad)} (the captured graph shows it; at wrap time fx could not trace that "
            f"code). {_FIX[tp.source]} (their parameters then stay whole on every TP rank), or give that code a "
            "module of its own to call")


_FIX = {"user": "Leave those modules out of tp_plan=",
        "transformers": "Pass tp_plan= with the model's own plan (model._tp_plan) less those modules",
        "derived": "Pass tp_plan= naming the pairs to split without those modules"}


def refuse_outside_reads(model: nn.Module, tp: TensorParallelPlan) -> None:
    """Raise ``TensorParallelPlanError`` when a given plan's TP section (``plan=``) splits a parameter that
    code outside its module reads (``outside_reads``): the pass would have kept it whole."""
    found = outside_reads(model, tp)
    if found:
        raise TensorParallelPlanError(
            f"plan= splits {listed(sorted(found))} across the TP group, but "
            + "; ".join(f"{m}: {why}" for m, why in sorted(found.items()))
            + ". Make the plan again for this model (the pass keeps them whole), or drop those entries from "
            "plan.tensor_parallel")


def _full(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _reads(module: nn.Module, params: dict[int, str], untraceable: set[type]) -> dict[int, str]:
    """Split parameter id -> how ``module``'s own code reads it (in its fx graph, else its source)."""
    if type(module).forward is nn.Module.forward:  # a container never called (ModuleList, ModuleDict)
        return {}
    if type(module) in untraceable:
        return _source_reads(module, params)
    try:
        graph = _OwnCodeTracer().trace(module)
    except Exception:  # any: what fx cannot trace is read from source
        untraceable.add(type(module))
        return _source_reads(module, params)
    reads: dict[int, str] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            p = module.get_parameter(str(node.target))
        except AttributeError:  # a buffer or a constant
            continue
        users = [u for u in node.users if not _metadata_read(u)]
        if id(p) in params and users:
            reads.setdefault(id(p), f"fx: {_describe(users[0])}")
    return reads


def _metadata_read(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is builtins.getattr and len(node.args) > 1
            and node.args[1] in _METADATA)


def _describe(node: fx.Node) -> str:
    if node.op == "call_function":
        return f"{getattr(node.target, '__name__', node.target)}(...)"
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_module":
        return f"passed to {node.target}"
    return "returned" if node.op == "output" else node.op


# ---- where fx cannot trace: the forward's source and the methods of self it calls -------------------------
@dataclass(frozen=True)
class _Code:
    """What one function's source reads: (attribute, the ``self.a.b`` path read from or None, line) per
    attribute read, and the names it calls as ``self.name(...)``."""

    file: str
    reads: tuple[tuple[str, tuple[str, ...] | None, int], ...]
    self_calls: frozenset[str]


def _source_reads(module: nn.Module, params: dict[int, str]) -> dict[int, str]:
    """Reads of split parameters in ``module``'s forward source (and the methods of self it calls): a
    ``self.a.b.weight`` read resolves to one parameter; a ``.weight`` read of anything else (a local alias
    bound more than once, ``self.get_input_embeddings()``, ``getattr(m, "weight")``) may be any split
    ``weight`` below."""
    by_attr: dict[str, list[int]] = defaultdict(list)
    for pid, name in params.items():
        by_attr[name.rpartition(".")[2]].append(pid)
    reads: dict[int, str] = {}
    todo, seen = ["forward"], {"forward"}
    while todo:
        method = todo.pop()
        fn = getattr(type(module), method)
        code = _code(fn)
        where = f"{type(module).__name__}.{method}"
        if code is None:  # no source to read: every split parameter below may be read
            return reads | {pid: f"{where} has no source to read, and fx cannot trace it" for pid in params}
        for attr, path, line in code.reads:
            for pid in by_attr.get(attr, ()):
                if path is None or _resolve(module, path) is _resolve(module, params[pid].split(".")[:-1]):
                    reads.setdefault(pid, f"{where} at {code.file}:{line}, read from source: fx cannot trace it")
        calls = {n for n in code.self_calls - seen if inspect.isfunction(getattr(type(module), n, None))}
        seen |= calls
        todo += sorted(calls)
    return reads


@functools.cache
def _code(fn: Callable) -> _Code | None:
    """``fn``'s reads (``_Code``), or None without source."""
    try:
        fn = inspect.unwrap(fn)  # a decorated forward (transformers'): the source and file are the function's
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    metadata = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in _METADATA}
    aliases = _aliases(tree)
    reads, calls = [], set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            calls.add(node.func.attr)
        read = _attribute_read(node, aliases)
        if read is not None and id(node) not in metadata:
            reads.append((*read, first + node.lineno - 1))
    return _Code(Path(inspect.getsourcefile(fn) or "?").name, tuple(reads), frozenset(calls))


def _aliases(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """Local names bound once, to a ``self.a.b`` path (``embed = self.embed``): name -> the path."""
    assigned: dict[str, list[tuple[str, ...] | None]] = defaultdict(list)
    bindings: Counter[str] = Counter()  # every binding: assignments, unpacking, loops, arguments, del
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id].append(_self_path(node.value, {}))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bindings[node.id] += 1
        elif isinstance(node, ast.arg):
            bindings[node.arg] += 1
    return {name: paths[0] for name, paths in assigned.items()
            if len(paths) == 1 and paths[0] is not None and bindings[name] == 1}


def _self_path(node: ast.AST, aliases: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """``self.a.b`` (or ``x.b`` with ``x`` an alias of ``self.a``) as ``("a", "b")``; None for anything else."""
    path: list[str] = []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return tuple(path)
    return aliases[node.id] + tuple(path) if isinstance(node, ast.Name) and node.id in aliases else None


def _attribute_read(node: ast.AST, aliases: dict[str, tuple[str, ...]]
                    ) -> tuple[str, tuple[str, ...] | None] | None:
    """(attribute, the ``self.a.b`` path it is read from, or None when not such a path) for ``x.attr`` or
    ``getattr(x, "attr")``; None for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        name = node.args[1] if len(node.args) > 1 else None
        return (name.value, None) if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return node.attr, _self_path(node.value, aliases)
    return None


def _resolve(module: nn.Module, path: tuple[str, ...] | list[str]) -> nn.Module | None:
    for name in path:
        module = module._modules.get(name)  # type: ignore[assignment]
        if module is None:
            return None
    return module
