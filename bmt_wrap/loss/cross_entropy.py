"""``FusedCrossEntropy``: cross-entropy over (N, C) logits without an fp32 copy of the logits."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ..errors import BMTError, UnsupportedError
from ..job.distributed import parallel_layout
from ..kernels import cupy_usable
from . import cupy_rows, torch_rows
from .vocab_parallel import vocab_parallel_rows

REDUCTIONS = ("mean", "sum", "none")


def _backend(logits: torch.Tensor) -> ModuleType:
    return cupy_rows if logits.dtype in cupy_rows.KERNEL_DTYPES and cupy_usable(logits) else torch_rows


class _RowCrossEntropy(torch.autograd.Function):
    """Per-row losses (fp32); saves only the logits and one fp32 log-sum-exp per row for backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                smoothing: float) -> torch.Tensor:
        backend = _backend(logits)
        loss, lse = backend.forward(logits, target, ignore_index, smoothing)
        ctx.save_for_backward(logits, target, lse)
        ctx.backend, ctx.ignore_index, ctx.smoothing = backend, ignore_index, smoothing
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, target, lse = ctx.saved_tensors
        row_scale = torch.where(target != ctx.ignore_index, grad_loss.float(), 0.0).contiguous()
        return ctx.backend.backward(logits, target, lse, row_scale, ctx.smoothing), None, None, None


class FusedCrossEntropy(torch.nn.Module):
    """Cross-entropy between (N, C) logits of any float dtype and (N,) class indices, like
    ``torch.nn.functional.cross_entropy`` (``weight``, ``ignore_index``, ``reduction``,
    ``label_smoothing``) but returning an fp32 loss and never materialising fp32 logits: a CuPy kernel on
    CUDA, slices of rows through torch on CPU. ``mean`` averages over the rows whose target is not
    ``ignore_index``, weighted by ``weight[target]`` when class weights are given (torch's rule).

    The signature is BMTrain's: ``(weight=None, ignore_index=-100, reduction="mean",
    label_smoothing=0.0, parallel=False)``. With ``parallel=True`` the logits are this tensor-parallel
    rank's ``(N, V/T)`` columns of the vocabulary (``VPEmbedding(projection=True)``'s output), the target
    is whole, and every TP rank gets the whole loss (``weight`` then has ``V`` entries).
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, parallel: bool = False) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise BMTError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise BMTError(f"label_smoothing={label_smoothing} must be in [0, 1]")
        if parallel and label_smoothing > 0:
            raise UnsupportedError("FusedCrossEntropy(parallel=True) with label_smoothing= is not supported; "
                                   "use label_smoothing=0 (BMTrain's vocabulary-parallel loss has none either)")
        if weight is not None and label_smoothing > 0:
            raise UnsupportedError("FusedCrossEntropy with both weight= and label_smoothing= is not supported; "
                                   "use torch.nn.functional.cross_entropy for that combination")
        self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.parallel = parallel

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of ``input`` (N, C) against ``target`` (N,)."""
        if input.dim() != 2 or target.shape != input.shape[:1]:
            raise BMTError(f"FusedCrossEntropy takes (N, C) logits and (N,) targets; got {tuple(input.shape)} and "
                           f"{tuple(target.shape)}: flatten first, e.g. loss(logits.view(-1, C), labels.view(-1))")
        target = target.long().contiguous()
        valid = target != self.ignore_index
        comm = parallel_layout().tp if self.parallel else None
        classes = input.shape[1] * (comm.world_size if comm is not None else 1)
        if input.device.type == "cpu" and bool(((target < 0) | (target >= classes))[valid].any()):
            raise BMTError(f"a target is outside [0, {classes}) and is not ignore_index={self.ignore_index}")
        if comm is not None:
            rows = vocab_parallel_rows(input.contiguous(), target, self.ignore_index, comm)
        else:
            rows = _RowCrossEntropy.apply(input.contiguous(), target, self.ignore_index, self.label_smoothing)
        count: torch.Tensor = valid.sum()
        if self.weight is not None:
            if self.weight.shape != (classes,):
                raise BMTError(f"weight has shape {tuple(self.weight.shape)} but the logits have "
                               f"{classes} classes: give one weight per class")
            row_weight = self.weight.to(rows.device, torch.float32)[torch.where(valid, target, 0)] * valid
            rows = rows * row_weight
            count = row_weight.sum()
        if self.reduction == "none":
            return rows
        if self.reduction == "sum":
            return rows.sum()
        return rows.sum() / count
