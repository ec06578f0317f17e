"""Cross-entropy of a vocabulary projection, a chunk of rows at a time: the logits are never whole.

Each chunk's logits are made from its hidden states, turned into that chunk's loss and its gradients
(hidden states, weight, bias), and freed, so at most one chunk's logits exist at once. The gradients are
computed in forward for an incoming gradient of 1 and scaled by the real one in backward: one matmul for
the logits and two for the gradients, the three an unfused head and its loss run (Liger's fused linear
cross-entropy does the same). No gradient entry is dropped or filtered.

Between the projection and the loss a model may apply elementwise steps (an ``Epilogue``): casts (the
fp32 upcast transformers' loss makes), a logit scale (Cohere), Gemma-2's final softcapping
``cap * tanh(logits / cap)``. They run on each chunk in the model's order and dtype, so each chunk's logits
are bit-identical to the unfused model's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base._compat import set_version_counters, tensor_version
from ..base.fused_loss_plan import chunk_rows
from ..errors import BMTError
from ..runtime.comm import Communicator
from . import vocab_parallel

#: Elementwise steps between the projection and the loss: ("cast", dtype), ("div", s), ("mul", s), ("tanh", None).
Epilogue = tuple[tuple[str, Any], ...]
EPILOGUE_OPS = ("cast", "div", "mul", "tanh")
REDUCTIONS = ("mean", "sum")


def softcap(cap: float) -> Epilogue:
    """Gemma-2's ``final_logit_softcapping``: ``cap * tanh(logits / cap)``, in transformers' order."""
    return (("div", cap), ("tanh", None), ("mul", cap))


def logit_scale(scale: float) -> Epilogue:
    """Cohere's ``logit_scale``: ``logits * scale``."""
    return (("mul", scale),)


def apply_epilogue(x: torch.Tensor, epilogue: Epilogue) -> torch.Tensor:
    """``x`` after the epilogue's steps, in order."""
    for op, arg in epilogue:
        if op == "cast":
            x = x.to(arg)
        elif op == "div":
            x = x / arg
        elif op == "mul":
            x = x * arg
        elif op == "tanh":
            x = torch.tanh(x)
        else:
            raise BMTError(f"unknown epilogue step {op!r}; the steps are {EPILOGUE_OPS}")
    return x


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here (autocast's, else the operands')."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point():
        return torch.get_autocast_dtype(device)
    if hidden.dtype != weight.dtype:
        raise BMTError(f"the hidden states are {hidden.dtype} and the projection's weight {weight.dtype}: "
                       "F.linear needs one dtype (cast the model, or run under torch.autocast)")
    return hidden.dtype


def _linear_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(h, w, b)`` for 2-D ``h``, written into ``out``: the same kernel (mm, or addmm with a bias)."""
    return torch.mm(h, w.t(), out=out) if b is None else torch.addmm(b, h, w.t(), out=out)


def _add_weight_grad(acc: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``acc + dz^T @ h`` in the fp32 accumulator ``acc``, made by the first chunk (no zero fill to add to)."""
    if acc is None:
        return (dz.t() @ h).float()
    if dz.dtype == acc.dtype:
        return acc.addmm_(dz.t(), h)
    return acc.add_(dz.t() @ h)


def _chunk_grads(z: torch.Tensor, target: torch.Tensor, epilogue: Epilogue, ignore_index: int,
                 smoothing: float, row_scale: torch.Tensor, comm: Communicator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss (fp32) and d(sum of row_scale * row loss)/dz, in z's dtype, written over
    ``z``'s fp32 logits where it can (``comm``: z holds this tensor-parallel rank's columns of the vocabulary)."""
    zr = z.detach().requires_grad_()
    with torch.enable_grad():
        xf = apply_epilogue(zr, epilogue).float()
    # The fp32 logits are this chunk's own unless the epilogue's backward keeps them: of its steps only
    # tanh saves its output (casts and scalings save nothing).
    in_place = xf is zr or type(xf.grad_fn).__name__ != "TanhBackward0"
    x = xf.detach()
    rows, state = vocab_parallel.rows_forward(x, target, ignore_index, smoothing, comm, in_place=in_place)
    exps = state.exps if in_place else torch.exp(x - state.top[:, None])
    dx = vocab_parallel.rows_backward(exps, state, row_scale, smoothing, comm.world_size if comm else 1)
    dz = dx if xf is zr else torch.autograd.grad(xf, zr, dx)[0]
    return rows.sum(), dz


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                target: torch.Tensor, epilogue: Epilogue, ignore_index: int, smoothing: float, reduction: str,
                rows: int, comm: Communicator | None) -> torch.Tensor:
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        dtype = compute_dtype(hidden, weight)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        valid = target != ignore_index
        scale = 1.0 / valid.sum().float() if reduction == "mean" else torch.ones((), dtype=torch.float32)
        row_scale = torch.where(valid, scale, 0.0).to(hidden.device)  # all rows ignored: nan loss, zero gradients
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w: torch.Tensor | None = None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Every chunk's logits go into one buffer: a fresh one per chunk cost its pages' first touch each
        # time (a quarter of the projection's time on the CPU), and held two chunks while the next was made.
        logits = hidden.new_empty((min(rows, hidden.shape[0]), w.shape[0]), dtype=dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, hidden.shape[0], rows):
                h = hidden[a:a + rows].to(dtype)
                z = _linear_into(logits[:h.shape[0]], h, w, b)
                chunk_loss, dz = _chunk_grads(z, target[a:a + rows], epilogue, ignore_index, smoothing,
                                              row_scale[a:a + rows], comm)
                total += chunk_loss
                if grad_h is not None:
                    grad_h[a:a + rows] = dz @ w
                if want_w:
                    grad_w = _add_weight_grad(grad_w, dz, h)
                if grad_b is not None:
                    grad_b += dz.sum(0, dtype=torch.float32)
                del z, dz  # an epilogue's chunk-sized tensors go before the next chunk's are made
        if want_w and grad_w is None:  # no rows
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = []
        # A loss's own backward brings exactly 1, by which scaling changes no bit: skip its pass over the
        # head's gradient (read on the CPU only, where it costs no device sync).
        unit = grad.device.type == "cpu" and bool(grad == 1)
        # In place: these gradients belong to this call alone (a second backward through it raises,
        # as autograd does for any saved tensor changed in place; unscaled ones are marked changed).
        for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if g is not None and unit:
                set_version_counters([g], [tensor_version(g) + 1])
            elif g is not None:
                g.mul_(grad.to(g.dtype))
            grads.append(g.to(dtype) if g is not None else None)
        return (*grads, None, None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, epilogue: Epilogue = (), rows: int | None = None,
                         comm: Communicator | None = None) -> torch.Tensor:
    """``F.cross_entropy(epilogue(F.linear(hidden, weight, bias)), target, ...)`` a chunk of ``rows`` rows at a
    time (default ``chunk_rows(vocab)``); the loss is fp32, gradients in the inputs' dtypes.

    ``comm``: the vocabulary is split over this tensor-parallel group, ``weight`` (and ``bias``) being this
    rank's rows; each chunk all-reduces its rows' max and sums, the loss is whole on every rank, and the
    hidden states' gradient is this rank's part (pass ``copy_to_tp(hidden)``, whose backward sums it).
    """
    if reduction not in REDUCTIONS:
        raise BMTError(f"linear_cross_entropy reduces by 'mean' or 'sum', got {reduction!r}; for per-row "
                       "losses use FusedCrossEntropy(reduction='none') on the logits")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise BMTError(f"hidden states {tuple(hidden.shape)} do not fit a projection weight {tuple(weight.shape)}: "
                       "the weight is (vocabulary, hidden)")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if target.numel() != flat.shape[0]:
        raise BMTError(f"{target.numel()} targets for {flat.shape[0]} rows of hidden states: give one target "
                       "per row")
    for op, _ in epilogue:
        if op not in EPILOGUE_OPS:
            raise BMTError(f"unknown epilogue step {op!r}; the steps are {EPILOGUE_OPS}")
    rows = rows or chunk_rows(weight.shape[0])  # this rank's columns: a chunk costs what it costs without TP
    return _LinearCrossEntropy.apply(flat, weight, bias, target.reshape(-1).long(), tuple(epilogue),
                                     ignore_index, float(label_smoothing), reduction, rows, comm)
