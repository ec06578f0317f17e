"""``fused_loss=True``: the plan's vocabulary head returns lazy logits in training calls, a cross-entropy on
them runs the chunked op, and the call returns no logits the loss took (docs/design.md "Fused loss").

The model's own forward runs, as always: only the head's forward changes, and only while the head is in
training mode with gradients on, so evaluation and generation are untouched. A head that is a product in
the model's code (``F.linear(h, self.embed.weight)``, ``h @ W.t()``) has no forward to change: its weight is
read as a ``HeadWeight`` during a training call instead (``loss/product_head.py``). A training call that
computes no loss gets its logits computed whole before the root's parameters are released. A head that
tensor parallelism split by vocabulary (and gathered) makes this rank's columns only: the loss is
vocabulary-parallel, and no logits are gathered.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from ..base._compat import pytree
from ..base.fused_loss_plan import FusedLossPlan
from ..errors import PlanError, UnsupportedError
from ..loss.lazy_logits import LazyLogits, drop_or_materialize
from ..loss.product_head import HeadWeight
from ..runtime.tp_ops import copy_to_tp
from .compiled import never_traced
from .tensor_parallel import tp_split


def _lazy_head_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    if not (self.training and torch.is_grad_enabled()):
        return self._bmt_unfused_forward(hidden)
    split = tp_split(self)
    if split is None:
        return LazyLogits.of(hidden, self.weight, self.bias)
    # Vocabulary-parallel: this rank's rows of the head; the hidden states' gradient is summed over TP.
    return LazyLogits.of(copy_to_tp(hidden, split[1]), self.weight, self.bias, comm=split[1])


def _drop_taken_logits(model: nn.Module, args: tuple, output: Any) -> Any:
    if not any(isinstance(x, LazyLogits) for x in pytree.tree_leaves(output)):
        return None
    return drop_or_materialize(output)


def fused_head(model: nn.Module) -> nn.Linear | None:
    """The head whose forward ``install_fused_loss`` replaced, if any."""
    for m in model.modules():
        forward = m.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ is _lazy_head_forward:
            return m  # type: ignore[return-value]
    return None


class _ProductHead:
    """Where the head product's weight is registered (every name of a tied one), marked for a training call."""

    def __init__(self, model: nn.Module, section: FusedLossPlan) -> None:
        owner, _, attr = (section.weight or "").rpartition(".")
        try:
            registered = model.get_submodule(owner)._parameters[attr]
        except (AttributeError, KeyError):
            raise PlanError(f"the plan fuses the loss with the {section.product} of parameter {section.weight!r}, "
                            f"which {type(model).__name__} does not have; regenerate the plan for this model") from None
        self.kind = section.product or ""
        self.locations = [(m, a) for m in model.modules() for a, p in m._parameters.items() if p is registered]
        self.marked: list[tuple[nn.Module, str, torch.Tensor]] = []

    def mark(self) -> None:
        """Read the weight (as installed for this call) as a ``HeadWeight`` wherever it is registered."""
        module, attr = self.locations[0]
        current = module._parameters[attr]
        marker = HeadWeight.of(current, self.kind)
        self.marked = [(m, a, current) for m, a in self.locations if m._parameters[a] is current]
        for m, a, _ in self.marked:
            m._parameters[a] = marker

    def unmark(self) -> None:
        """Put back what ``mark`` replaced (the root's own hook then puts back the shards)."""
        for m, a, t in self.marked:
            if isinstance(m._parameters[a], HeadWeight):
                m._parameters[a] = t
        self.marked = []


def _mark_product(model: nn.Module, args: tuple) -> None:
    head = model.__dict__.get("_bmt_product_head")
    if head is not None and model.training and torch.is_grad_enabled():
        head.mark()


def _unmark_product(model: nn.Module, args: tuple, output: Any) -> None:
    head = model.__dict__.get("_bmt_product_head")
    if head is not None:
        head.unmark()


def _hook_product_head(model: nn.Module) -> None:
    """The hooks that mark a product head's weight during training calls (once; they act once
    ``model._bmt_product_head`` is set). After the root's own pre-hook, which installs the gathered weight:
    registered at wrap time, they act from the first call even when that call's capture finds the head."""
    if "_bmt_product_head" in model.__dict__:
        return
    model._bmt_product_head = None
    model.register_forward_pre_hook(never_traced(_mark_product))
    model.register_forward_hook(never_traced(_unmark_product), prepend=True, always_call=True)


def install_fused_loss(model: nn.Module, section: FusedLossPlan | None) -> None:
    """Fuse ``section``'s head with its loss in ``model`` (once; nothing unless the section is fused, or pending:
    then a product head the first call finds is fused from that call on)."""
    if section is None or not section.enabled:
        return
    if section.pending or (section.fused and section.product is not None):
        _hook_product_head(model)
        if section.fused and model._bmt_product_head is None:
            model._bmt_product_head = _ProductHead(model, section)
            model.register_forward_hook(never_traced(_drop_taken_logits), prepend=True)
        return
    if not section.fused or fused_head(model) is not None:
        return
    try:
        head = model.get_submodule(section.head or "")
    except AttributeError:
        head = None
    if not isinstance(head, nn.Linear):
        raise PlanError(f"the plan fuses the loss with head {section.head!r}, which is not an nn.Linear of "
                        f"{type(model).__name__}; regenerate the plan for this model")
    split = tp_split(head)
    if split is not None and split[0] != "colwise_gather":
        raise UnsupportedError(f"fused_loss=True with head {section.head!r} split {split[0]!r} by tensor "
                               "parallelism: only a head split by vocabulary and gathered (colwise_gather) fuses; "
                               "split it so (tp_plan=) or pass fused_loss=False")
    head._bmt_unfused_forward = head.forward  # nn.Linear's, or the tensor-parallel style's
    head.forward = types.MethodType(_lazy_head_forward, head)  # type: ignore[method-assign]
    # Before the root's own hook: logits computed whole need the root's parameters still gathered.
    model.register_forward_hook(never_traced(_drop_taken_logits), prepend=True)
