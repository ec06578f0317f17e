"""``model.verify(...)``: train the wrapped model beside a plain copy and report how far they drift."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..base._compat import pytree
from ..errors import ParityError
from ..job.distributed import get_state
from ..runtime.param import DistributedParameter
from ..runtime.sharded_tensor import local_view

# docs/design.md's tolerances, measured on a perfect data-parallel reference in fp32.
LOSS_RTOL = 1e-5
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


@dataclass
class StepDiff:
    """Largest differences at one step (over every rank)."""

    step: int
    loss: float  # |mean loss over ranks - reference loss|
    grad: float  # max |sharded grad - reference grad slice|
    param: float  # max |sharded param - reference param slice| after the optimizer step
    excess: float = 0.0  # > 0: the loss or some gradient is outside the tolerance (see ``verify``)

    @property
    def ok(self) -> bool:
        """True if the loss and every gradient element were within tolerance at this step."""
        return self.excess <= 0.0


@dataclass
class VerifyReport:
    """Per-step differences between the wrapped model and the plain reference."""

    steps: list[StepDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True if every step was within tolerance."""
        return all(s.ok for s in self.steps)

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
    s, e = p.source_range()
    return full.detach().reshape(-1)[s:e].to(p.dtype)


def _max_diff(model: nn.Module, reference: nn.Module, grads: bool) -> tuple[float, float]:
    """Largest absolute difference, and largest excess over ``GRAD_TOL`` (> 0: out of tolerance)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    worst, excess = 0.0, float("-inf")
    for name, p in model.named_parameters():
        if not isinstance(p, DistributedParameter) or name not in ref:
            continue
        mine = p.grad if grads else p
        theirs = ref[name].grad if grads else ref[name]
        if mine is None or theirs is None or p.to_local().numel() == 0:
            continue
        expected = _local(theirs, p).float()
        diff = (local_view(mine).detach().float() - expected).abs()
        worst = max(worst, float(diff.max()))
        excess = max(excess, float((diff - GRAD_TOL["atol"] - GRAD_TOL["rtol"] * expected.abs()).max()))
    return worst, excess


def verify(model: nn.Module, reference: nn.Module, batches: Iterable[Any],
           loss_fn: Callable[[nn.Module, Any], torch.Tensor],
           optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
           steps: int = 3, strict: bool = True) -> VerifyReport:
    """Train ``model`` (wrapped) and ``reference`` (a plain copy made before wrapping) side by side.

    ``batches`` are global batches: the reference sees all of each, this rank's model its slice along
    dim 0 of every tensor. A collective: every rank calls it. Returns the largest differences per step;
    with ``strict`` (the default) raises ``ParityError`` when a loss differs by more than ``LOSS_RTOL``
    relative or a gradient element by more than ``GRAD_TOL`` (docs/design.md's tolerances, as in
    ``torch.testing.assert_close``). Parameters are reported, not judged: the optimizer's own arithmetic
    may amplify rounding noise (Adam on near-zero gradients).
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
        grad_diff, grad_excess = _max_diff(model, reference, grads=True)
        diffs = torch.tensor([0.0, grad_diff, 0.0, grad_excess], dtype=torch.float64)
        mean = loss.detach().double().reshape(1).clone()
        comm.all_reduce(mean, "avg", label="verify loss")
        diffs[0] = abs(float(mean) - float(ref_loss.detach()))
        diffs[3] = max(float(diffs[3]), float(diffs[0]) - LOSS_RTOL * abs(float(ref_loss.detach())))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        diffs[2] = _max_diff(model, reference, grads=False)[0]
        comm.all_reduce(diffs, "max", label="verify differences")
        report.steps.append(StepDiff(step, *(float(x) for x in diffs)))
        if strict and not report.steps[-1].ok:
            s = report.steps[-1]
            raise ParityError(f"verify: step {step} is outside tolerance (loss difference {s.loss:.3g}, largest "
                              f"gradient difference {s.grad:.3g}; tolerances: loss rtol {LOSS_RTOL}, gradients "
                              f"rtol {GRAD_TOL['rtol']} atol {GRAD_TOL['atol']}). Pass strict=False to get the "
                              "report anyway; report the model and plan (model.plan.to_json()) as a bug.")
    return report


def attach_verify(model: nn.Module) -> None:
    """Give a wrapped model its ``verify`` method."""
    model.verify = MethodType(verify, model)
