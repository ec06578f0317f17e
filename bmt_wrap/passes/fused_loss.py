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

import functools
import inspect
import operator
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..base._compat import UNSAFE_VIEW_OP
from ..base.fused_loss_plan import FusedLossPlan, chunk_rows, index_keeps_last_dim
from ..base.tp_plan import TensorParallelPlan
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


@functools.cache
def _calls_loss_function(cls: type) -> bool:
    """Whether ``cls``'s own forward calls ``self.loss_function`` (transformers' models)."""
    return "loss_function" in inspect.unwrap(cls.forward).__code__.co_names


def _loss_kind(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    if node.op == "call_function" and node.target in (F.cross_entropy, aten.cross_entropy_loss.default):
        # Read from the calling module's code: the capture records no Python stacks (a quarter of its time).
        owner = _module(node, modules) or modules.get("")
        via = owner is not None and _calls_loss_function(type(owner))
        return "cross_entropy" + (" (transformers' loss_function)" if via else "")
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


#: Products of the hidden states with a parameter that make logits outside an nn.Linear (a tied embedding's
#: ``F.linear(h, self.embed.weight)``, ``h @ W.t()``, a bare Parameter ``h @ self.lm_head``).
_PRODUCTS: dict[Any, str] = {F.linear: "F.linear", aten.linear.default: "F.linear", torch.matmul: "matmul",
                             operator.matmul: "matmul", aten.matmul.default: "matmul", torch.mm: "matmul",
                             aten.mm.default: "matmul", "matmul": "matmul", "mm": "matmul"}
_SWAPS = {torch.t, aten.t.default, aten.numpy_T.default, "t"}  # a 2-D tensor transposed, whatever its arguments
_TRANSPOSES = {torch.transpose, aten.transpose.int, "transpose"}
_PERMUTES = {torch.permute, aten.permute.default, "permute"}
#: What a graph reads of a tensor without its values (fx records ``x.shape``, ``x.size(-1)`` as nodes).
_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda")
_METADATA_METHODS = ("size", "dim")


def _swaps(node: fx.Node) -> bool | None:
    """True when ``node`` transposes a 2-D tensor (``W.t()``, ``W.T``, ``W.transpose(0, 1)``, ``W.permute(1, 0)``),
    False for a transpose or permute that leaves it as it is, None for any other node."""
    target = node.target if node.op in ("call_function", "call_method") else None
    if target in _SWAPS or (target is getattr and node.args[1] in ("T", "mT")):
        return True
    if target in _TRANSPOSES and len(node.args) == 3 and all(isinstance(d, int) for d in node.args[1:]):
        return node.args[1] % 2 != node.args[2] % 2  # type: ignore[operator]
    if target in _PERMUTES:
        dims = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
            else list(node.args[1:])
        return [d % 2 for d in dims] == [1, 0] if all(isinstance(d, int) for d in dims) else None
    return None


def _parameter_read(node: object) -> tuple[str, bool, list[fx.Node]] | None:
    """The parameter ``node`` reads through transposes: its name, whether it arrives transposed, and the
    transposes on the way (``node`` first); None when ``node`` is no such read."""
    flipped, chain = False, []
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return unwrapped_name(str(node.target)), flipped, chain
        swap = _swaps(node)
        if swap is None:
            return None
        flipped ^= swap
        chain.append(node)
        node = node.args[0]
    return None


class _Product:
    """A product of the hidden states with a 2-D parameter: which, and which way round its weight is."""

    def __init__(self, kind: str, weight: str, vocab_first: bool, chain: list[fx.Node], bias: bool) -> None:
        self.kind, self.weight, self.chain, self.bias = kind, weight, chain, bias
        self.vocab_first = vocab_first  # the parameter is (vocabulary, hidden), as F.linear's weight


def _product(node: fx.Node, params: dict[str, nn.Parameter]) -> _Product | None:
    """``node`` as ``F.linear(h, W[, b])`` or ``h @ W.t()`` / ``h @ P`` with W, P 2-D parameters; None if it is not."""
    if node.op not in ("call_function", "call_method") or len(node.args) < 2:
        return None
    kind = _PRODUCTS.get(node.target)
    if kind is None or _parameter_read(node.args[0]) is not None:
        return None
    read = _parameter_read(node.args[1])
    if read is None or read[0] not in params or params[read[0]].dim() != 2:
        return None
    name, flipped, chain = read
    if kind == "F.linear":  # F.linear's weight is (vocabulary, hidden) as it is; a transposed one is no head
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return None if flipped else _Product(kind, name, True, chain, bias is not None)
    return _Product(kind, name, flipped, chain, False)


def _reads_metadata(node: fx.Node) -> bool:
    """True when ``node`` reads only a tensor's metadata (``logits.shape``, ``logits.size(-1)``)."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in _METADATA_ATTRS
    return node.op == "call_method" and node.target in _METADATA_METHODS


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
        self.head: fx.Node | None = None  # the node that makes the logits
        self.head_name: str | None = None  # the nn.Linear it calls
        self.product: _Product | None = None  # or the product with a parameter it is
        self.path: list[fx.Node] = []  # steps from the head to the loss, in graph order
        self.reason: str | None = None


def _trace_back(loss: fx.Node, kind: str, modules: dict[str, nn.Module], params: dict[str, nn.Parameter]) -> _Match:
    match = _Match(loss, kind)
    x = loss.args[0]
    while isinstance(x, fx.Node):
        name = _head_name(x, modules)
        product = _product(x, params) if name is None else None
        if name is not None or product is not None:
            match.head, match.head_name, match.product = x, name, product
            match.path.reverse()
            return match
        if _step_kind(x) in (None, _SKIP):
            match.reason = (f"the loss's input comes from {_describe(x)} ({x.name}), which is neither a projection "
                            "(an nn.Linear, or F.linear or a matmul with a parameter) nor a step the fused op "
                            "replays per chunk")
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
            if (user in chain or user is match.loss or user.op == "output" or _step_kind(user) == _SKIP
                    or _reads_metadata(user)):
                continue
            match.reason = (f"the logits ({node.name}) also feed {_describe(user)} ({user.name}), which needs "
                            "them whole")
            return


def _dims(match: _Match, modules: dict[str, nn.Module], params: dict[str, nn.Parameter]) -> tuple[int, int, bool]:
    """The projection's vocabulary, hidden width and whether it adds a bias."""
    if match.product is not None:
        shape = params[match.product.weight].shape
        vocab, hidden = (shape[0], shape[1]) if match.product.vocab_first else (shape[1], shape[0])
        return vocab, hidden, match.product.bias
    head = modules[match.head_name or ""]
    assert isinstance(head, nn.Linear)
    return head.out_features, head.in_features, head.bias is not None


def _bytes(match: _Match, vocab: int, hidden: int, bias: bool) -> dict[str, int | None]:
    """The bytes at stake at the captured input (export records every node's shape; fx does not)."""
    out = _value(match.head) if match.head is not None else None
    if out is None:
        return {}
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
    head_grad = (vocab * hidden + (vocab if bias else 0)) * 4
    return {"vocab": vocab, "rows": rows, "logits_bytes": out.numel() * out.element_size(),
            "unfused_bytes": sum(v.numel() * v.element_size() for v in made) + 2 * log_probs,
            "fused_bytes": chunk * vocab * per_logit + grad_h + head_grad,
            "saved_bytes": log_probs + tanh_kept, "kept_bytes": grad_h}


def fuse_loss(graph: fx.Graph, model: nn.Module, *, enabled: bool,
              split: Collection[str] = ()) -> tuple[fx.Graph, FusedLossPlan]:
    """The graph with the vocabulary projection and its cross-entropy drawn as one node (when found and
    ``enabled``), and the plan's section saying what was found, the bytes at stake, or why not. ``split``:
    the parameters tensor parallelism splits (``TensorParallelPlan.split_names``)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    losses = [(n, k) for n in graph.nodes if (k := _loss_kind(n, modules)) is not None]
    if not losses:
        return graph, FusedLossPlan(enabled, reason="the captured call computes no cross-entropy in the root "
                                    "(called without labels?): pass example_inputs= with labels, or call "
                                    "with labels first")
    if len(losses) > 1:
        return graph, FusedLossPlan(enabled, reason=f"{len(losses)} cross-entropy calls in the root; the pass "
                                    "fuses a single one")
    match = _trace_back(*losses[0], modules, params)
    if match.reason is None:
        _check_uses(match)
    if match.reason is None:
        options = _loss_options(match.loss, modules)
        if options["weight"] is not None:
            match.reason = "the cross-entropy has class weights, which the fused op does not take"
        elif options["reduction"] not in ("mean", "sum"):
            match.reason = (f"reduction={options['reduction']!r} returns one loss per token, which the fused op "
                            "does not (it reduces by 'mean' or 'sum')")
    split_ids = {id(params[n]) for n in split if n in params}  # a tied weight is split under any of its names
    if match.reason is None and match.product is not None and id(params[match.product.weight]) in split_ids:
        match.reason = (f"tensor parallelism splits {match.product.weight}, which the logits' {match.product.kind} "
                        "reads: the vocabulary-parallel form takes an nn.Linear head split by vocabulary and "
                        "gathered (colwise_gather); make the head an nn.Linear, or leave the weight whole (tp_plan=)")
    section = FusedLossPlan(
        enabled, head=match.head_name, loss=match.kind, steps=[_describe(n) for n in match.path],
        reason=match.reason, weight=_weight_name(match),
        product=match.product.kind if match.product is not None else None,
        **(_bytes(match, *_dims(match, modules, params)) if match.head is not None else {}))  # type: ignore[arg-type]
    if not section.fused:
        return graph, section
    return _draw(graph, match), section


def _weight_name(match: _Match) -> str | None:
    if match.head is None:
        return None
    if match.product is not None:
        return match.product.weight
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
        fused = new.call_function(fused_linear_cross_entropy, (head.args[0], _drawn_weight(new, head, match),
                                                               loss.args[1]),
                                  {k: v for k, v in _loss_options(match.loss, {}).items() if k != "weight"}
                                  if match.loss.op != "call_module" else {})
    loss.replace_all_uses_with(fused)
    new.erase_node(loss)
    output = next(n for n in new.nodes if n.op == "output")
    output.args = fx.map_arg(output.args, lambda n: None if n in gone else n)  # the fused call returns no logits
    for node in reversed(list(new.nodes)):  # what only the pair read goes too (the weight's transposes, shapes)
        if node.op in ("call_function", "call_method") and node.users and all(u in gone for u in node.users):
            gone.add(node)
    for node in reversed(list(new.nodes)):
        if node in gone and not node.users:  # a shape read elsewhere keeps its node (LazyLogits answer shapes)
            new.erase_node(node)
    return new


def _drawn_weight(new: fx.Graph, head: fx.Node, match: _Match) -> fx.Node:
    """The (vocabulary, hidden) weight the fused node takes, read in ``new`` (before the loss)."""
    if head.op == "call_module":
        return new.get_attr(f"{head.target}.weight")
    if match.product is None:
        return head.args[1]  # type: ignore[return-value]  # aten.linear's weight
    read = _parameter_read(head.args[1])
    assert read is not None
    param = read[2][-1].args[0] if read[2] else head.args[1]
    return param if match.product.vocab_first else new.call_method("t", (param,))  # type: ignore[return-value,arg-type]


def with_fused_loss(capture: Capture, section: FusedLossPlan) -> Capture:
    """``capture`` carrying ``section`` (the plan made from it takes it: its phases count the pair and the
    head's gradient), with the root's activations the fused op changes: the unfused pair's saved tensors
    out, the hidden states' gradient it keeps in (its weight gradient is the root's, which the plan counts)."""
    profile = capture.activations
    if profile is None or not section.fused or section.saved_bytes is None:
        return replace(capture, fused_loss=section)
    root = profile.root_bytes - section.saved_bytes + (section.kept_bytes or 0)
    return replace(capture, activations=replace(profile, root_bytes=root), fused_loss=section)


def fused_loss_section(model: nn.Module, capture: Capture | None, *, enabled: bool,
                       tensor_parallel: TensorParallelPlan | None = None) -> FusedLossPlan:
    """The plan's section for ``model`` from its capture (the graph of fx, or of the export of a call);
    ``tensor_parallel``: the plan's TP section, whose split parameters a product head cannot read whole."""
    if capture is None or capture.method == "none":
        return FusedLossPlan(enabled, pending=True, reason="the root's graph is captured at the first call (or "
                             "from example_inputs=), which finds the vocabulary head and its loss")
    if capture.method not in ("fx", "export"):
        return FusedLossPlan(enabled, reason=f"the root's graph is unknown: neither fx nor torch.export captured "
                             f"the model (capture: {capture.method}), so no head and loss can be found in it")
    split = tensor_parallel.split_names() if tensor_parallel is not None and tensor_parallel.tp_size > 1 else ()
    try:
        return fuse_loss(capture.graph, model, enabled=enabled, split=split)[1]
    except Exception as exc:  # an optional analysis: a graph it misreads leaves the pair unfused, never the wrap
        return FusedLossPlan(enabled, reason=f"the pass could not read the root's graph ({describe(exc)})")
