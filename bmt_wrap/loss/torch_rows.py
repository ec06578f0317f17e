"""Per-row cross-entropy with torch ops, a slice of rows at a time (CPU, or CUDA without CuPy).

Only one slice of rows is ever converted to fp32, so half-precision logits never get a full fp32
copy; the backward recomputes the softmax from the logits and the saved per-row log-sum-exp.
"""

from __future__ import annotations

import torch

#: Logit elements per slice of rows.
_SLICE = 1 << 20


def _row_slices(n_rows: int, n_classes: int) -> range:
    return range(0, n_rows, max(1, _SLICE // max(1, n_classes)))


def forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 for ignored rows) and log-sum-exp, both fp32."""
    n_rows, n_classes = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).unsqueeze(1)
    step = _row_slices(n_rows, n_classes).step
    for a in _row_slices(n_rows, n_classes):
        x = logits[a:a + step].float()
        row_lse = torch.logsumexp(x, dim=1)
        rows = (1.0 - smoothing) * (row_lse - x.gather(1, safe[a:a + step]).squeeze(1))
        if smoothing > 0:
            rows += smoothing * (row_lse - x.mean(dim=1))
        loss[a:a + step] = torch.where(valid[a:a + step], rows, 0.0)
        lse[a:a + step] = row_lse
    return loss, lse


def backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor,
             smoothing: float) -> torch.Tensor:
    """d(sum of row_scale * row loss)/d logits, in the logits' dtype (``row_scale`` is 0 on ignored rows)."""
    n_rows, n_classes = logits.shape
    grad = torch.empty_like(logits)
    safe = target.clamp(0, n_classes - 1).unsqueeze(1)  # ignored rows: any column, scaled by 0 below
    step = _row_slices(n_rows, n_classes).step
    for a in _row_slices(n_rows, n_classes):
        probs = (logits[a:a + step].float() - lse[a:a + step, None]).exp_()
        if smoothing > 0:
            probs.sub_(smoothing / n_classes)
        probs.scatter_add_(1, safe[a:a + step], probs.new_full((probs.shape[0], 1), smoothing - 1.0))
        grad[a:a + step] = probs.mul_(row_scale[a:a + step, None])
    return grad
