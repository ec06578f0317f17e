"""Tensor parallelism for the one-liner: which modules to split across the TP group (pure, one process).

The plan comes from, in order: ``tp_plan=`` (a dict in transformers' vocabulary, module-name patterns with
``*`` for one name component), the transformers model's own plan (``model._tp_plan``: the LM head's and
``config.base_model_tp_plan``), or column -> row pairs derived from each block's fx graph (with the known
attentions of ``FUSED_ATTENTIONS``, which fx cannot trace). A Linear here is an ``nn.Linear`` or
transformers' ``Conv1D`` (GPT-2's: the same map with its weight stored transposed). A column Linear whose
parent cuts its output into equal parts (a fused q/k/v: ``split_size``) is split strided, as Megatron splits
its fused QKV: each TP rank gets its heads' slice of every part, and the parent's ``split_size`` and head
count become the TP-local ones.
Whatever cannot be shown to compute the same function split stays replicated, with the reason in the plan.
Errors (sizes not divisible by the TP size, a pattern that names no module) are raised here, before the
model is changed, and alike on every rank (every rank runs this pass on the same model).
"""

from __future__ import annotations

import operator
import re
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..base.tp_plan import HeadRewrite, Replicated, TensorParallelPlan, TPEntry
from ..errors import TensorParallelPlanError, listed
from .discover import Discovery
from .tp_uses import outside_reads

#: transformers' style names -> ours (``base/tp_plan.py`` SPLIT_STYLES), or None: keep the module whole.
STYLES: dict[str, str | None] = {
    "colwise": "colwise", "colwise_rep": "colwise_gather", "colwise_gather_output": "colwise_gather",
    "rowwise": "rowwise", "rowwise_rep": "rowwise_split_input", "rowwise_split_input": "rowwise_split_input",
    "embedding_rowwise": "vocab_embedding", "replicate": None,
}
# An int attribute of a module holding split Linears whose name says it counts heads: the module's forward
# reshapes with it, so it must become the TP-local count (head_dim, head_size ... are widths, left alone).
_HEAD_COUNT = re.compile(r"^(n_|num_)?(attention_|key_value_|kv_|q_)?heads?$|^(n|num)_(kv_)?heads?$|^n_head$")
_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads")
# The width a parent cuts a fused projection's output by (GPT2Attention: ``.split(self.split_size, dim=2)``).
_PART_WIDTH = "split_size"
#: Attentions fx cannot trace whose forward is known (transformers' source, per class): styles of their
#: children, as transformers' tp plans give them. GPT2Attention cuts c_attn's output into q, k, v of
#: ``split_size`` each and reshapes each into heads of ``head_dim`` (``-1`` heads), and feeds the heads
#: concatenated to c_proj; a cross attention (``q_attn``, k/v from the encoder) is not listed.
FUSED_ATTENTIONS: dict[str, dict[str, str]] = {"GPT2Attention": {"c_attn": "colwise", "c_proj": "rowwise"}}
# Ops a column -> row pair may pass through: they act elementwise, so each TP rank computes its own slice.
# (transformers' activations are traced through: GPT-2's gelu_new is mul, add, pow and tanh.)
_ELEMENTWISE_FUNCS = {F.gelu, F.silu, F.relu, F.tanh, F.sigmoid, torch.tanh, torch.sigmoid, torch.relu,
                      operator.mul, operator.add, operator.pow, torch.mul, torch.add, torch.pow}
_ELEMENTWISE_METHODS = {"mul", "add", "pow", "relu", "sigmoid", "tanh"}
_ELEMENTWISE_MODULES = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


def linear_kind(module: nn.Module) -> str | None:
    """"linear" for an ``nn.Linear``, "conv1d" for transformers' ``Conv1D`` (weight ``[in, out]``,
    ``y = x @ W + b``), None for anything else: the modules the linear styles split."""
    if type(module) is nn.Linear:
        return "linear"
    cls = type(module)
    # Matched by name: the passes never import transformers, and a model that has Conv1D imported it.
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."):
        return "conv1d"
    return None


def known_attention(module: nn.Module) -> dict[str, str] | None:
    """``FUSED_ATTENTIONS``' styles for ``module``'s children, or None when it is not one of them."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.") or getattr(module, "is_cross_attention", False):
        return None
    return FUSED_ATTENTIONS.get(cls.__name__)


def plan_tensor_parallel(model: nn.Module, tp_size: int, discovery: Discovery,
                         tp_plan: dict[str, str] | None = None) -> TensorParallelPlan:
    """The TP section of ``model``'s plan for ``tp_size`` ranks; raises ``TensorParallelPlanError`` on sizes
    not divisible by ``tp_size`` or a ``tp_plan=`` pattern that names no module."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelPlanError(f"tp_size must be a positive int, got {tp_size!r}")
    plan = TensorParallelPlan(tp_size=tp_size, source="user" if tp_plan is not None else "transformers")
    styles = tp_plan if tp_plan is not None else getattr(model, "_tp_plan", None)
    if styles is None or not isinstance(styles, dict) or not styles:
        plan.source = "derived"
        styles = derive_pairs(model, discovery, plan)
    modules = dict(model.named_modules())
    chosen = _expand(styles, modules, plan, strict=plan.source == "user")
    _fill_entries(plan, chosen, modules, discovery)
    _replicate(plan, outside_reads(model, plan))
    _keep_tied_consistent(plan, model)
    _rewrite_heads(plan, model, modules)
    _check_divisible(plan, model)
    return plan


def _expand(styles: dict[str, str], modules: dict[str, nn.Module], plan: TensorParallelPlan,
            strict: bool) -> dict[str, str]:
    """Module name -> style, patterns expanded (``*`` is one name component)."""
    chosen: dict[str, str] = {}
    unknown = sorted({s for s in styles.values() if s not in STYLES})
    missing = []
    for pattern, style in styles.items():
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in modules if n and rx.match(n)]
        if not hits:
            missing.append(pattern)
        chosen.update((n, style) for n in hits)
    if strict and (missing or unknown):
        raise TensorParallelPlanError(
            (f"tp_plan= names no module for {listed(missing)}; module names look like "
             f"{listed([n for n in modules if n][:6])}." if missing else "")
            + (f" tp_plan= uses style(s) {listed(unknown)} bmt_wrap does not implement; it implements "
               f"{listed(list(STYLES), limit=len(STYLES))}." if unknown else ""))
    if missing:
        plan.notes.append(f"the model's tp plan names no module for {listed(missing)} (not in this config)")
    return chosen


def _fill_entries(plan: TensorParallelPlan, chosen: dict[str, str], modules: dict[str, nn.Module],
                  discovery: Discovery) -> None:
    """Turn (module, style) into entries; a module that cannot be split as asked stays replicated, and so do
    the other split modules beside it (same parent), whose layouts assumed it was split."""
    reasons: dict[str, str] = {}
    for name, style in chosen.items():
        ours, module = STYLES.get(style), modules[name]
        if ours is None:
            reasons[name] = ("the plan says replicate" if style == "replicate"
                             else f"style {style!r} is not implemented by bmt_wrap")
        elif ours == "vocab_embedding" and not isinstance(module, nn.Embedding):
            reasons[name] = f"{style!r} needs an nn.Embedding, this is {type(module).__name__}"
        elif ours == "vocab_embedding" and (module.padding_idx is not None or module.max_norm is not None):
            reasons[name] = "an embedding with padding_idx or max_norm is kept whole (its rows interact)"
        elif ours != "vocab_embedding" and linear_kind(module) is None:
            reasons[name] = (f"{style!r} needs an nn.Linear or transformers' Conv1D, this is "
                             f"{type(module).__name__}")
        elif ours == "colwise_gather" and _fused_parts(name, modules) > 1:
            reasons[name] = (f"{type(modules[_parent(name)]).__name__} cuts its output into parts (a fused "
                             "q/k/v): gathering a strided split's output whole is not implemented")
    poisoned = {_parent(n) for n, why in reasons.items() if not why.startswith("the plan says")}
    for name, style in chosen.items():
        if name in reasons:
            plan.replicated.append(Replicated(name, reasons[name]))
        elif _parent(name) in poisoned and STYLES[style] != "vocab_embedding":
            why = "a module beside it that the plan splits cannot be split (its partner's layout differs)"
            plan.replicated.append(Replicated(name, why))
        else:
            entry = _entry(name, STYLES[style] or "", modules[name], discovery)
            if entry.style == "colwise":
                entry.parts = _fused_parts(name, modules)
            plan.entries.append(entry)


def _fused_parts(name: str, modules: dict[str, nn.Module]) -> int:
    """Into how many equal parts Linear ``name``'s parent cuts its output (GPT-2's ``c_attn``:
    ``.split(self.split_size, dim=2)`` into q, k, v: 3); 1 when it does not."""
    parent, module = modules[_parent(name)], modules[name]
    width = getattr(parent, _PART_WIDTH, None)
    out = module.weight.shape[1 if linear_kind(module) == "conv1d" else 0]
    if type(width) is not int or width <= 0 or out == width or out % width:
        return 1
    return out // width


def _entry(name: str, style: str, module: nn.Module, discovery: Discovery) -> TPEntry:
    shapes = {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}
    if style == "vocab_embedding":
        kind, dims, fin, fout = "embedding", {"weight": 0}, 1, module.embedding_dim
    else:
        kind = linear_kind(module) or ""
        out_dim = 1 if kind == "conv1d" else 0  # the weight's output-feature dimension
        fout, fin = shapes["weight"][out_dim], shapes["weight"][1 - out_dim]
        col = style.startswith("colwise")
        bias = {"bias": 0} if col and "bias" in shapes else {}
        dims = {"weight": out_dim if col else 1 - out_dim, **bias}
    return TPEntry(module=name, style=style, kind=kind, split_dims=dims, full_shapes=shapes, in_features=fin,
                   out_features=fout, block=discovery.owner(name))


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _keep_tied_consistent(plan: TensorParallelPlan, model: nn.Module) -> None:
    """A parameter used in several places (tied weights) is split only if every use splits it the same way."""
    uses: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)].append(name)
    split = {f"{e.module}.{n}": (e, d) for e in plan.entries for n, d in e.split_dims.items()}
    bad: set[str] = set()
    for names in uses.values():
        dims = {split[n][1] if n in split else None for n in names}
        if len(names) > 1 and len(dims) > 1:
            bad.update(split[n][0].module for n in names if n in split)
    _replicate(plan, {m: "its weight is tied to a parameter not split the same way" for m in bad})


def _replicate(plan: TensorParallelPlan, reasons: dict[str, str]) -> None:
    """Keep the modules of ``reasons`` whole, and the column/row Linears beside a column/row one kept whole
    (same parent): a pair's layout assumed both were split."""
    kept = defaultdict(list)  # parent -> its column/row Linears kept whole
    for e in plan.entries:
        if e.module in reasons and e.style in ("colwise", "rowwise"):
            kept[_parent(e.module)].append(e.module)
    partners = {e.module: f"its column/row partner beside it, {listed(kept[_parent(e.module)])}, is kept whole"
                for e in plan.entries if e.module not in reasons and e.style in ("colwise", "rowwise")
                and _parent(e.module) in kept}
    gone = reasons | partners
    plan.replicated += [Replicated(e.module, gone[e.module]) for e in plan.entries if e.module in gone]
    plan.entries = [e for e in plan.entries if e.module not in gone]


def _rewrite_heads(plan: TensorParallelPlan, model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Head counts held by the modules around split Linears, and the part width of a fused projection's
    parent (``split_size``), to be set to their TP-local values.

    Only where every Linear of that module is split: a head count beside a Linear left whole (an attention
    kept replicated next to a split MLP) is that Linear's, and rewriting it would change the model. Derived
    pairs never pass through a reshape, so they involve no head count; a known attention's do.
    """
    bad = []
    split = {e.module for e in plan.entries}
    fused = {_parent(e.module): e for e in plan.entries if e.parts > 1}
    for parent in sorted({_parent(e.module) for e in plan.entries if e.style.startswith("colwise")}):
        if plan.source == "derived" and parent not in fused:
            continue
        counts = {a: v for a, v in vars(modules[parent]).items() if type(v) is int and _HEAD_COUNT.match(a)}
        whole = [n for n, c in modules[parent].named_children()
                 if linear_kind(c) and (f"{parent}.{n}" if parent else n) not in split]
        if parent in fused and whole:
            raise TensorParallelPlanError(
                f"{fused[parent].module} (a fused q/k/v: {type(modules[parent]).__name__} cuts its output into "
                f"{fused[parent].parts} parts) is split, but {listed([f'{parent}.{n}' for n in whole])} beside "
                "it is left whole and would get this rank's heads only: split it rowwise too, or leave both "
                "out of tp_plan= (that attention then stays whole on every TP rank)")
        if parent in fused:
            width = getattr(modules[parent], _PART_WIDTH)
            if width % plan.tp_size:
                bad.append(f"{parent}.{_PART_WIDTH} = {width}")
            else:
                plan.heads.append(HeadRewrite(parent, _PART_WIDTH, width, width // plan.tp_size))
        if counts and whole:
            names = listed([f"{parent}.{a}" for a in counts])
            plan.notes.append(f"head count(s) {names} kept: {parent} also holds Linears left whole "
                              f"({listed(whole)}), whose reshapes may read them")
            continue
        for attr, value in counts.items():
            if value % plan.tp_size:
                bad.append(f"{parent}.{attr} = {value}")
            else:
                plan.heads.append(HeadRewrite(parent, attr, value, value // plan.tp_size))
    config = getattr(model, "config", None)
    if plan.entries and config is not None:
        bad += [f"config.{k} = {getattr(config, k)}" for k in _CONFIG_HEADS
                if isinstance(getattr(config, k, None), int) and getattr(config, k) % plan.tp_size]
    if bad:
        raise TensorParallelPlanError(f"head counts not divisible by tp_size={plan.tp_size}: {listed(bad)}; "
                                      "each TP rank computes whole heads, so choose a tp_size dividing them")


def _check_divisible(plan: TensorParallelPlan, model: nn.Module) -> None:
    bad = [f"{e.module}.{n} {e.full_shapes[n]} along dim {d}" + (f" (each of its {e.parts} blocks)" if e.parts > 1
                                                                   else "")
           for e in plan.entries for n, d in e.split_dims.items() if e.full_shapes[n][d] % (e.parts * plan.tp_size)]
    if bad:
        raise TensorParallelPlanError(
            f"{type(model).__name__}: tp_size={plan.tp_size} does not divide {listed(bad)}; choose a tp_size "
            "dividing these sizes (features, vocabulary), or leave those modules out with tp_plan=")


# ---- column -> row pairs from each block's graph --------------------------------------------------------
def derive_pairs(model: nn.Module, discovery: Discovery, plan: TensorParallelPlan) -> dict[str, str]:
    """Styles for Linear pairs found in each block's fx graph: ``A`` (colwise) feeding ``B`` (rowwise) through
    elementwise ops only, used nowhere else. Linears on any other path stay replicated with the reason."""
    styles: dict[str, str] = {}
    for block in discovery.blocks:
        _derive_in(model.get_submodule(block.fqn), block.fqn, styles, plan)
    return styles


class _LinearLeafTracer(fx.Tracer):
    """fx's tracer with transformers' ``Conv1D`` kept as one call, as ``nn.Linear`` is."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return linear_kind(m) is not None or super().is_leaf_module(m, module_qualified_name)


def _derive_in(module: nn.Module, fqn: str, styles: dict[str, str], plan: TensorParallelPlan) -> None:
    """Pairs in ``module``'s graph; where fx cannot trace it (GPT-2's block and attention), in each child's.

    A pair lies within one forward, whose intermediate values its caller cannot read, so a child's graph
    proves a pair found there as a whole block's would (given the caller runs the child only through its
    forward, as modules are used). A known attention (``FUSED_ATTENTIONS``) is not traced: its styles are known.
    """
    if (known := known_attention(module)) is not None:
        styles.update({f"{fqn}.{child}": style for child, style in known.items()})
        return
    try:
        graph = _LinearLeafTracer().trace(module)
    except Exception as exc:  # any: what fx cannot trace is searched child by child, else not split
        for name, child in module.named_children():
            if linear_kind(child):
                plan.replicated.append(Replicated(
                    f"{fqn}.{name}", f"fx cannot trace {fqn} ({type(exc).__name__}), so what its output "
                    "feeds (a reshape into heads, a fused q/k/v split) is not proven to stay right when split"))
            else:
                _derive_in(child, f"{fqn}.{name}", styles, plan)
        return
    pairs, unpaired = _pairs(graph, module)
    for col, row in pairs:
        styles.update({f"{fqn}.{c}": "colwise" for c in col})
        styles[f"{fqn}.{row}"] = "rowwise"
    plan.replicated += [Replicated(f"{fqn}.{n}", why) for n, why in unpaired]


def _pairs(graph: fx.Graph, module: nn.Module) -> tuple[list[tuple[list[str], str]], list[tuple[str, str]]]:
    """((column Linears, row Linear) pairs, (Linear, reason) for the rest) in one block's graph."""
    linear = {n for n in graph.nodes
              if n.op == "call_module" and linear_kind(module.get_submodule(n.target)) is not None}
    calls = Counter(n.target for n in linear)
    paired: set[fx.Node] = set()
    pairs = []
    for row in (n for n in graph.nodes if n in linear):
        found = _columns_feeding(row.args[0], linear, module)
        if found is None:
            continue
        cols, path = found
        read_elsewhere = any(u not in path and u is not row for n in path for u in n.users)
        called_again = any(calls[n.target] > 1 for n in (*cols, row))  # one split serves every call
        if cols & paired or row in paired or read_elsewhere or called_again:
            continue
        paired |= cols | {row}
        pairs.append(([c.target for c in sorted(cols, key=lambda c: list(graph.nodes).index(c))], row.target))
    why = ("its output does not reach one Linear through elementwise ops only (a reshape, attention or "
           "residual is on the way), so splitting it is not proven safe; name it in tp_plan=")
    rest = {n.target: why for n in graph.nodes if n in linear and n not in paired}
    return pairs, list(rest.items())


def _columns_feeding(node: object, linear: set[fx.Node], module: nn.Module) -> tuple[set, set] | None:
    """(Linears, nodes on the way) when ``node`` is computed from Linears' outputs by elementwise ops only."""
    if not isinstance(node, fx.Node):
        return None
    if node in linear:
        return {node}, {node}
    if not _elementwise(node, module):
        return None
    cols, path = set(), {node}
    tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    for arg in tensors:
        found = _columns_feeding(arg, linear, module)
        if found is None:
            return None
        cols |= found[0]
        path |= found[1]
    return (cols, path) if cols else None


def _elementwise(node: fx.Node, module: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    if node.op == "call_module":
        sub = module.get_submodule(node.target)
        return isinstance(sub, _ELEMENTWISE_MODULES) or (isinstance(sub, nn.Dropout) and sub.p == 0)
    return False
