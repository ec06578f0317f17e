"""torch's Adafactor on sharded parameters without gathering any of them.

Adafactor's row and column statistics of a gradient are sums of squares along the last and the
second-to-last dimension: each rank adds up its range's squares into per-row and per-column partial sums,
and one all-reduce of those ``B·(m + n)`` values completes them. The factored second moment
(``row_var @ col_var``, replicated, as small as the parameter's rows and columns make it) is then read at
this rank's range, so the update, the parameter and every norm stay on the range; norms over all
elements are sums of squares with one all-reduce each. The arithmetic follows torch's single-tensor
Adafactor (``torch.optim._adafactor``) step for step, so results match it to fp32 rounding; state is
torch's (``step``, plain ``row_var``/``col_var``, sharded ``variance``), so ``state_dict`` is too.
"""

from __future__ import annotations

import torch

from ..runtime.sharded_tensor import ShardedTensor, ShardLayout

_INDEX = "_bmt_adafactor_index"


@torch.no_grad()
def sharded_adafactor_step(optimizer: torch.optim.Adafactor) -> None:
    """One step of ``optimizer`` (every parameter sharded or plain) as torch's single-tensor Adafactor."""
    for group in optimizer.param_groups:
        eps1, eps2 = group["eps"]
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        for p in group["params"]:
            if p.grad is None:
                continue
            _step_one(optimizer, p, group, lr, eps1, eps2)


def _step_one(optimizer: torch.optim.Adafactor, p: torch.Tensor, group: dict, lr: float,
              eps1: float | None, eps2: float) -> None:
    state = optimizer.state[p]
    grad = p.grad
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if grad.dim() > 1:
            state["row_var"] = grad.new_zeros([*grad.shape[:-1], 1])
            state["col_var"] = grad.new_zeros([*grad.shape[:-2], 1, grad.shape[-1]])
        else:
            state["variance"] = torch.zeros_like(grad)
    g = _local(grad)
    if group["maximize"]:
        g = -g
    if eps1 is None:
        eps1 = torch.finfo(p.dtype).eps
    step_t = state["step"]
    step_t += 1
    step_float = step_t.item()
    one_minus_beta2_t = step_float ** group["beta2_decay"]
    rho_t = min(lr, 1 / (step_float ** 0.5))
    alpha = max(eps2, _norm(p, _local(p)).item() / (p.numel() ** 0.5)) * rho_t
    local = _local(p)
    if group["weight_decay"] != 0:
        local.mul_(1 - lr * group["weight_decay"])
    if grad.dim() > 1:
        row_var, col_var = state["row_var"], state["col_var"]
        row_mean, col_mean = _row_col_means(optimizer, p, g)
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        var_local = _range_of(p, var_estimate).clone()
    else:
        variance = state["variance"]
        variance.lerp_(grad * grad, one_minus_beta2_t)  # (-g)² = g²: maximize changes nothing here
        var_local = _local(variance).clone()
    update = var_local.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(g)
    denom = max(1.0, _norm(p, update).item() / ((p.numel() ** 0.5) * group["d"]))
    local.add_(update, alpha=-alpha / denom)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, ShardedTensor) else t.reshape(-1)


def _range_of(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    return p.shard_layout.local_of_full(full) if isinstance(p, ShardedTensor) else full.reshape(-1)


def _norm(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The 2-norm over all of ``p``'s elements of a tensor laid out like ``p`` (one all-reduce if sharded)."""
    if not isinstance(p, ShardedTensor):
        return torch.linalg.vector_norm(local)
    return torch.linalg.vector_norm(ShardedTensor.wrap(local, p.shard_layout))


def _row_col_means(optimizer: torch.optim.Adafactor, p: torch.Tensor, g: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ``norm(grad, dim=-1, keepdim=True).square_().div_(n)`` and its column twin, from partial
    sums of squares of this rank's range and one all-reduce of all rows' and columns' sums."""
    shape = p.shape
    m, n = shape[-2], shape[-1]
    batch = p.numel() // (m * n)
    rows, cols = _indices(optimizer, p)
    sums = torch.zeros(batch * (m + n), dtype=torch.float64, device=g.device)
    sq = g.double().square()
    sums[:batch * m].index_add_(0, rows, sq)
    sums[batch * m:].index_add_(0, cols, sq)
    if isinstance(p, ShardedTensor):
        p.shard_layout.all_reduce(sums, "sum", "Adafactor row and column sums")
    norms = sums.sqrt().to(g.dtype)
    row_mean = norms[:batch * m].view(*shape[:-1], 1).square_().div_(n)
    col_mean = norms[batch * m:].view(*shape[:-2], 1, n).square_().div_(m)
    return row_mean, col_mean


def _indices(optimizer: torch.optim.Adafactor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element of this rank's range: its row among all rows, its column among all columns."""
    cache = optimizer.__dict__.setdefault(_INDEX, {})
    layout: ShardLayout | None = p.shard_layout if isinstance(p, ShardedTensor) else None
    start, end = (layout.start, layout.end) if layout is not None else (0, p.numel())
    key = (id(p), start, end)
    if key not in cache:
        m, n = p.shape[-2], p.shape[-1]
        flat = torch.arange(start, end, device=p.device)
        rows = flat // n  # row among batch·m rows
        cols = (flat // (m * n)) * n + flat % n  # column among batch·n columns
        cache[key] = (rows, cols)
    return cache[key]
