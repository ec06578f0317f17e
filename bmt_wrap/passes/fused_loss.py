"""Fused loss: in the root's captured graph, find the projection to the vocabulary whose output feeds a
cross-entropy, and replace the pair with one chunked op (``fused_loss=True``).

The graph is fx's (plain PyTorch: ``call_module`` of an ``nn.Linear``, ``F.cross_entropy`` or an
``nn.CrossEntropyLoss``) or the condensed export of the first call (transformers: ``aten.linear``, then
``aten.cross_entropy_loss``, which its ``loss_function``/``ForCausalLMLoss`` calls after shifting the
labels). Between the two only steps the op replays chunk by chunk may run: casts, reshapes and slices that
keep the vocabulary last, multiplication or division by a constant, ``tanh`` (Gemma-2's softcapping,
Cohere's logit scale). The logits may be returned besides (the fused call returns ``logits=None``);
anything else reading them leaves the pair unfused, with the reason in the plan's section.

Pure: graph and module types in, a drawn graph and the plan's section out; the model runs its own forward
(``wrapping/fused_loss.py``).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..base._compat import UNSAFE_VIEW_OP
from ..base.fused_loss_plan import FusedLossPlan, chunk_rows, index_keeps_last_dim
from ..errors import PlanError
from .capture import Capture
from .export_graph import unwrapped_name
from .util import describe

aten = torch.ops.aten

_CAST, _ROWS, _SCALE, _TANH, _SKIP = "cast", "rows", "scale", "tanh", "skip"
_ATEN_STEPS: dict[Any, str] = {
    aten.to.dtype: _CAST, aten.to.dtype_layout: _CAST, aten._to_copy.default: _CAST,
    aten.view.default: _ROWS, aten.reshape.default: _ROWS, UNSAFE_VIEW_OP: _ROWS,
    aten.contiguous.default: _ROWS, aten.alias.default: _ROWS, aten.clone.default: _ROWS,
    aten.flatten.using_ints: _ROWS, aten.slice.Tensor: _ROWS,
    aten.mul.Tensor: _SCALE, aten.mul.Scalar: _SCALE, aten.div.Tensor: _SCALE, aten.div.Scalar: _SCALE,
    aten.tanh.default: _TANH, aten._assert_tensor_metadata.default: _SKIP,
}
_FUNCTION_STEPS: dict[Any, str] = {
    operator.getitem: _ROWS, torch.flatten: _ROWS, torch.reshape: _ROWS, operator.mul: _SCALE,
    operator.truediv: _SCALE, torch.mul: _SCALE, torch.div: _SCALE, torch.tanh: _TANH,
}
_METHOD_STEPS = {"float": _CAST, "to": _CAST, "view": _ROWS, "reshape": _ROWS, "flatten": _ROWS,
                 "contiguous": _ROWS, "mul": _SCALE, "div": _SCALE, "tanh": _TANH}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten.cross_entropy_loss's reduction argument


def fused_linear_cross_entropy(hidden: object, weight: object, target: object, **loss: object) -> None:
    """Stands for the chunked op (``bmt_wrap.loss.linear_cross_entropy``) in the drawn graph."""
    raise PlanError("the fused-loss node of a drawn graph is not run: the model runs its own forward, whose "
                    "head wrapping/fused_loss.py replaces")


def _value(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _module(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    if node.op == "call_module":
        return modules.get(str(node.target))
    stack = node.meta.get("nn_module_stack") or {}
    if node.op != "call_function" or not stack:
        return None
    return modules.get(unwrapped_name(list(stack.values())[-1][0]))


def _head_name(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """The name of the ``nn.Linear`` this node calls (fx's ``call_module`` or export's ``aten.linear``)."""
    if node.op == "call_module" or (node.op == "call_function" and node.target is aten.linear.default):
        module = _module(node, modules)
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            return next(n for n, m in modules.items() if m is module)
    return None


def _loss_kind(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    if node.op == "call_function" and node.target in (F.cross_entropy, aten.cross_entropy_loss.default):
        trace = str(node.meta.get("stack_trace") or "")
        return "cross_entropy" + (" (transformers' loss_function)" if "loss_function" in trace else "")
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), nn.CrossEntropyLoss):
        return f"nn.CrossEntropyLoss ({node.target})"
    return None


def _loss_options(node: fx.Node, modules: dict[str, nn.Module]) -> dict[str, Any]:
    """weight, reduction, ignore_index and label_smoothing of a loss call, as the graph records them."""
    if node.op == "call_module":
        m = modules[str(node.target)]
        return {"weight": m.weight, "reduction": m.reduction, "ignore_index": m.ignore_index,
                "label_smoothing": m.label_smoothing}
    if node.target is F.cross_entropy:
        kw = {"weight": None, "reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0, **node.kwargs}
        return {k: kw[k] for k in ("weight", "reduction", "ignore_index", "label_smoothing")}
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    given = dict(zip(names, node.args[2:], strict=False)) | dict(node.kwargs)
    return {"weight": given.get("weight"), "reduction": _REDUCTIONS[given.get("reduction", 1)],
            "ignore_index": given.get("ignore_index", -100), "label_smoothing": given.get("label_smoothing", 0.0)}


def _step_kind(node: fx.Node) -> str | None:
    if node.op == "call_function":
        kind = _ATEN_STEPS.get(node.target) or _FUNCTION_STEPS.get(node.target)
    elif node.op == "call_method":
        kind = _METHOD_STEPS.get(str(node.target))
    else:
        return None
    if kind == _SCALE and any(isinstance(a, fx.Node) for a in node.args[1:]):
        return None  # a tensor operand: not one constant for every logit
    if node.target is aten.slice.Tensor:
        val = _value(node)
        dim = node.args[1] if len(node.args) > 1 else 0
        if val is None or dim in (-1, val.dim() - 1):
            return None
    if node.target is operator.getitem and not index_keeps_last_dim(node.args[1], 2 ** 31):
        return None
    return kind


#: Products with a parameter that make logits outside an nn.Linear (a custom projection, a bare Parameter).
_PRODUCTS: dict[Any, str] = {F.linear: "F.linear", aten.linear.default: "F.linear", torch.matmul: "matmul",
                             operator.matmul: "matmul", aten.matmul.default: "matmul", aten.mm.default: "matmul"}
_TRANSPOSES = {torch.t, aten.t.default, aten.transpose.int, aten.permute.default, "t", "transpose", "permute"}


def _parameter_read(node: object) -> str | None:
    """The parameter ``node`` reads, through transposes."""
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return unwrapped_name(str(node.target))
        if node.op not in ("call_function", "call_method") or node.target not in _TRANSPOSES:
            return None
        node = node.args[0]
    return None


def _bare_projection(node: fx.Node) -> str | None:
    """Why a product with a parameter outside an nn.Linear is not fused, with the fix; None if it is not one."""
    kind = _PRODUCTS.get(node.target) if node.op == "call_function" else None
    name = next((p for a in node.args[:2] if (p := _parameter_read(a)) is not None), None) if kind else None
    if name is None:
        return None
    return (f"the logits come from {kind} on parameter {name} outside an nn.Linear module; the fused op takes over "
            "an nn.Linear head's forward: make the projection an nn.Linear (a tied weight can be assigned to its "
            ".weight) to fuse it")


def _describe(node: fx.Node) -> str:
    if node.op == "call_function" and node.target is operator.getitem:
        return "[...]"
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    consts = [repr(a) for a in node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return f"{str(name).split('.')[0]}{'(' + ', '.join(consts) + ')' if consts else ''}"


class _Match:
    """A loss node traced back to its head."""

    def __init__(self, loss: fx.Node, kind: str) -> None:
        self.loss, self.kind = loss, kind
        self.head: fx.Node | None = None
        self.head_name: str | None = None
        self.path: list[fx.Node] = []  # steps from the head to the loss, in graph order
        self.reason: str | None = None


def _trace_back(loss: fx.Node, kind: str, modules: dict[str, nn.Module]) -> _Match:
    match = _Match(loss, kind)
    x = loss.args[0]
    while isinstance(x, fx.Node):
        name = _head_name(x, modules)
        if name is not None:
            match.head, match.head_name = x, name
            match.path.reverse()
            return match
        if _step_kind(x) in (None, _SKIP):
            match.reason = _bare_projection(x) or (
                f"the loss's input comes from {_describe(x)} ({x.name}), which is neither an nn.Linear "
                "projection nor a step the fused op replays per chunk")
            return match
        match.path.append(x)
        x = x.args[0]
    match.reason = "the loss's input is not computed in the graph"
    return match


def _check_uses(match: _Match) -> None:
    """The logits may go on to the loss, to the output, or to checks; any other reader needs them whole."""
    chain = {match.head, *match.path}
    for node in chain:
        for user in node.users:
            if user in chain or user is match.loss or user.op == "output" or _step_kind(user) == _SKIP:
                continue
            match.reason = (f"the logits ({node.name}) also feed {_describe(user)} ({user.name}), which needs "
                            "them whole")
            return


def _bytes(match: _Match, head: nn.Linear) -> dict[str, int | None]:
    """The bytes at stake at the captured input (export records every node's shape; fx does not)."""
    out = _value(match.head) if match.head is not None else None
    if out is None:
        return {}
    vocab, hidden = head.out_features, head.in_features
    rows = out.numel() // vocab
    values = [(n, v) for n in match.path if (v := _value(n)) is not None]
    made = [out] + [v for n, v in values if _step_kind(n) in (_SCALE, _TANH)
                    or (_step_kind(n) == _CAST and v.dtype != _value(n.args[0]).dtype)]  # type: ignore[union-attr]
    log_probs = rows * vocab * 4  # fp32, kept by the loss for backward, which makes their gradient beside them
    tanh_kept = sum(v.numel() * v.element_size() for n, v in values if _step_kind(n) == _TANH)
    grad_h = rows * hidden * out.element_size()
    chunk = min(rows, chunk_rows(vocab))
    # A chunk's fp32 logits become its exponentials and then its gradient in place; a cast or an epilogue
    # adds the chunk in the model's dtype and the epilogue's gradient beside them.
    per_logit = 4 if len(made) == 1 and out.element_size() == 4 else out.element_size() + 2 * 4
    # The weight's (and bias's) fp32 gradient is made in forward and held into backward.
    head_grad = (vocab * hidden + (vocab if head.bias is not None else 0)) * 4
    return {"vocab": vocab, "rows": rows, "logits_bytes": out.numel() * out.element_size(),
            "unfused_bytes": sum(v.numel() * v.element_size() for v in made) + 2 * log_probs,
            "fused_bytes": chunk * vocab * per_logit + grad_h + head_grad,
            "saved_bytes": log_probs + tanh_kept, "kept_bytes": grad_h}


def fuse_loss(graph: fx.Graph, model: nn.Module, *, enabled: bool) -> tuple[fx.Graph, FusedLossPlan]:
    """The graph with the vocabulary projection and its cross-entropy drawn as one node (when found and
    ``enabled``), and the plan's section saying what was found, the bytes at stake, or why not."""
    modules = dict(model.named_modules())
    losses = [(n, k) for n in graph.nodes if (k := _loss_kind(n, modules)) is not None]
    if not losses:
        return graph, FusedLossPlan(enabled, reason="the captured call computes no cross-entropy in the root "
                                    "(called without labels?): pass example_inputs= with labels, or call "
                                    "with labels first")
    if len(losses) > 1:
        return graph, FusedLossPlan(enabled, reason=f"{len(losses)} cross-entropy calls in the root; the pass "
                                    "fuses a single one")
    match = _trace_back(*losses[0], modules)
    if match.reason is None:
        _check_uses(match)
    if match.reason is None:
        options = _loss_options(match.loss, modules)
        if options["weight"] is not None:
            match.reason = "the cross-entropy has class weights, which the fused op does not take"
        elif options["reduction"] not in ("mean", "sum"):
            match.reason = (f"reduction={options['reduction']!r} returns one loss per token, which the fused op "
                            "does not (it reduces by 'mean' or 'sum')")
    head = modules[match.head_name] if match.head_name is not None else None
    section = FusedLossPlan(
        enabled, head=match.head_name, loss=match.kind, steps=[_describe(n) for n in match.path],
        reason=match.reason, weight=_weight_name(match, modules),
        **(_bytes(match, head) if isinstance(head, nn.Linear) else {}))  # type: ignore[arg-type]
    if not section.fused:
        return graph, section
    return _draw(graph, match), section


def _weight_name(match: _Match, modules: dict[str, nn.Module]) -> str | None:
    if match.head is None:
        return None
    if match.head.op == "call_module":
        return f"{match.head.target}.weight"
    weight = match.head.args[1]
    return unwrapped_name(str(weight.target)) if isinstance(weight, fx.Node) and weight.op == "get_attr" else None


def _draw(graph: fx.Graph, match: _Match) -> fx.Graph:
    """A copy of ``graph`` with the head, its steps and the loss replaced by one ``fused_linear_cross_entropy``."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new.output(new.graph_copy(graph, env))
    head, loss = env[match.head], env[match.loss]  # type: ignore[index]
    gone = {env[n] for n in (match.head, *match.path)}  # type: ignore[index]
    gone |= {u for n in gone for u in n.users if _step_kind(u) == _SKIP}
    with new.inserting_before(loss):
        weight = head.args[1] if head.op == "call_function" else new.get_attr(f"{head.target}.weight")
        fused = new.call_function(fused_linear_cross_entropy, (head.args[0], weight, loss.args[1]),
                                  {k: v for k, v in _loss_options(match.loss, {}).items() if k != "weight"}
                                  if match.loss.op != "call_module" else {})
    loss.replace_all_uses_with(fused)
    new.erase_node(loss)
    output = next(n for n in new.nodes if n.op == "output")
    output.args = fx.map_arg(output.args, lambda n: None if n in gone else n)  # the fused call returns no logits
    for node in reversed(list(new.nodes)):
        if node in gone:
            new.erase_node(node)
    return new


def with_fused_loss(capture: Capture, section: FusedLossPlan) -> Capture:
    """``capture`` carrying ``section`` (the plan made from it takes it: its phases count the pair and the
    head's gradient), with the root's activations the fused op changes: the unfused pair's saved tensors
    out, the hidden states' gradient it keeps in (its weight gradient is the root's, which the plan counts)."""
    profile = capture.activations
    if profile is None or not section.fused or section.saved_bytes is None:
        return replace(capture, fused_loss=section)
    root = profile.root_bytes - section.saved_bytes + (section.kept_bytes or 0)
    return replace(capture, activations=replace(profile, root_bytes=root), fused_loss=section)


def fused_loss_section(model: nn.Module, capture: Capture | None, *, enabled: bool) -> FusedLossPlan:
    """The plan's section for ``model`` from its capture (the graph of fx, or of the export of a call)."""
    if capture is None or capture.method not in ("fx", "export"):
        how = capture.method if capture is not None else "none"
        return FusedLossPlan(enabled, reason=f"the root's graph is unknown (capture: {how}); it is captured at "
                             "the first call, or from example_inputs=")
    try:
        return fuse_loss(capture.graph, model, enabled=enabled)[1]
    except Exception as exc:  # an optional analysis: a graph it misreads leaves the pair unfused, never the wrap
        return FusedLossPlan(enabled, reason=f"the pass could not read the root's graph ({describe(exc)})")
