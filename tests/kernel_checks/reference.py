"""Float64 references the kernel and optimizer tests compare against."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReferenceAdamW:
    """``torch.optim.AdamW`` (single-tensor path) on float64 copies of some tensors."""

    def __init__(self, initial: Sequence[torch.Tensor], groups: Sequence[tuple[Sequence[int], dict]]) -> None:
        self.params = [torch.nn.Parameter(t.detach().double().clone()) for t in initial]
        self.opt = torch.optim.AdamW([dict(params=[self.params[i] for i in idx], **hyper) for idx, hyper in groups],
                                     foreach=False)

    def step(self, grads: Sequence[torch.Tensor | None]) -> None:
        """One update with these gradients (None: the parameter gets no gradient this step)."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.detach().double().reshape(p.shape).clone()
        self.opt.step()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at the magnitude of each float64 value in ``x``."""
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(info.tiny)))
    return info.eps * torch.pow(2.0, exponent)


def assert_within_one_rounding(actual: torch.Tensor, reference: torch.Tensor) -> None:
    """``actual`` (low precision) is within one rounding step of ``reference`` (float64) cast to its dtype."""
    if actual.numel() == 0:
        return
    expected = reference.to(actual.dtype).double()
    gap = (actual.double() - expected).abs()
    bound = ulp(reference, actual.dtype)
    worst = int(torch.argmax(gap - bound))
    assert bool((gap <= bound).all()), (f"element {worst}: {actual.reshape(-1)[worst].item()} vs reference "
                                        f"{reference.reshape(-1)[worst].item()} (one step = {bound.reshape(-1)[worst].item()})")
