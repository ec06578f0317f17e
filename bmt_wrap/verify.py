"""``model.verify(...)``: train the wrapped model beside a plain copy and report how far they drift."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .distributed import get_state
from .runtime.param import DistributedParameter


@dataclass
class StepDiff:
    """Largest differences at one step (over every rank)."""

    step: int
    loss: float  # |mean loss over ranks - reference loss|
    grad: float  # max |sharded grad - reference grad slice|
    param: float  # max |sharded param - reference param slice| after the optimizer step


@dataclass
class VerifyReport:
    """Per-step differences between the wrapped model and the plain reference."""

    steps: list[StepDiff] = field(default_factory=list)

    @property
    def max_loss(self) -> float:
        """Largest loss difference over all steps."""
        return max((s.loss for s in self.steps), default=0.0)

    @property
    def max_grad(self) -> float:
        """Largest gradient difference over all steps."""
        return max((s.grad for s in self.steps), default=0.0)

    @property
    def max_param(self) -> float:
        """Largest parameter difference over all steps."""
        return max((s.param for s in self.steps), default=0.0)


def _local(full: torch.Tensor, p: DistributedParameter) -> torch.Tensor:
    s, e = p._bmt_buffer.slot_source_range(p._bmt_slot)
    return full.detach().reshape(-1)[s:e].to(p.dtype)


def _max_diff(model: nn.Module, reference: nn.Module, grads: bool) -> float:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in model.named_parameters():
        if not isinstance(p, DistributedParameter) or name not in ref:
            continue
        mine = p.grad if grads else p
        theirs = ref[name].grad if grads else ref[name]
        if mine is None or theirs is None or p.numel() == 0:
            continue
        worst = max(worst, float((mine.detach().float() - _local(theirs, p).float()).abs().max()))
    return worst


def verify(model: nn.Module, reference: nn.Module, batches: Iterable[Any],
           loss_fn: Callable[[nn.Module, Any], torch.Tensor],
           optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
           steps: int = 3) -> VerifyReport:
    """Train ``model`` (wrapped) and ``reference`` (a plain copy made before wrapping) side by side.

    ``batches`` are global batches: the reference sees all of each, this rank's model its slice along
    dim 0 of every tensor. A collective: every rank calls it. Returns the largest differences per step.
    """
    state = get_state()
    comm, n, r = state.comm, state.world_size, state.rank
    opt, ref_opt = optimizer_factory(model.parameters()), optimizer_factory(reference.parameters())
    report = VerifyReport()
    for step, batch in enumerate(batches):
        if step >= steps:
            break
        local = pytree.tree_map(lambda t: t.chunk(n)[r] if isinstance(t, torch.Tensor) else t, batch)
        ref_loss = loss_fn(reference, batch)
        ref_loss.backward()
        loss = loss_fn(model, local)
        loss.backward()
        diffs = torch.tensor([0.0, _max_diff(model, reference, grads=True), 0.0], dtype=torch.float64)
        mean = loss.detach().double().reshape(1).clone()
        comm.all_reduce(mean, "avg", label="verify loss")
        diffs[0] = abs(float(mean) - float(ref_loss.detach()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        diffs[2] = _max_diff(model, reference, grads=False)
        comm.all_reduce(diffs, "max", label="verify differences")
        report.steps.append(StepDiff(step, *(float(x) for x in diffs)))
    return report


def attach_verify(model: nn.Module) -> None:
    """Give a wrapped model its ``verify`` method."""
    model.verify = MethodType(verify, model)
