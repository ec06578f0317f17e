"""Train a model plainly in one process and sharded on every rank, side by side, and compare.

Every rank builds the same reference (same seed) and trains it on the global batch locally; the sharded
copy trains on this rank's slice. Tolerances are docs/design.md's (measured on a perfect data-parallel
reference): losses rtol 1e-5; under SGD(lr=0.1) grads and params assert_close(rtol=1e-5, atol=1e-6);
under AdamW the per-tensor relative norm of the parameter difference is at most 5e-3.

``train_side_by_side(strict=False)`` records every violation in ``result["failures"]`` instead of raising at
the first (benchmarks/coverage.py sweeps hundreds of models and wants each one's worst differences);
``sliced_reference=True`` trains the reference on each rank's slice in turn with the gradients averaged
(models whose forward couples the rows of a batch, such as BatchNorm, compute per-rank statistics by
nature); ``reseed`` reseeds before each model's step so dropout draws the same masks in both (N=1).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import bmt_wrap as bmt
from bmt_wrap.runtime.sharded_tensor import ShardedTensor

LOSS_RTOL = 1e-5
SGD_TOL = {"rtol": 1e-5, "atol": 1e-6}
ADAMW_REL = 5e-3
NOISE_GRAD = 1e-6  # a reference gradient never above this is fp32 rounding noise around an exact zero


def whole(t: torch.Tensor, param: torch.Tensor | None = None) -> torch.Tensor:
    """A parameter or gradient as a user script reads it whole: ``full_tensor()`` (a collective) when sharded,
    then concatenated over the TP group when ``param`` (default ``t``) is split by tensor parallelism."""
    full = t.full_tensor() if isinstance(t, ShardedTensor) else t.detach()
    param = t if param is None else param
    if not getattr(param, "_tp_mode", False):
        return full
    return _tp_joined([full], [param])[0]


def wholes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """``whole(t, param)`` of every pair, gathered with one collective per shard group and dtype (and one over
    TP) instead of one per tensor: at 4 ranks sharing 2 cores a collective costs its latency, not its bytes,
    and a model's worth of them per step was most of a parity test's time. Every rank passes the same list."""
    out: list[torch.Tensor] = [t.detach() for t, _ in pairs]
    batches: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, (t, _) in enumerate(pairs):
        if isinstance(t, ShardedTensor) and (not t.numel() or t.shard_layout.stage is not None):
            out[i] = t.full_tensor()  # nothing to gather, or another pipeline stage may hold it (a broadcast)
        elif isinstance(t, ShardedTensor):
            batches.setdefault((id(t.shard_layout.buffer.comm), t.dtype), []).append(i)
    for idx in batches.values():
        for i, full in zip(idx, _gathered([pairs[i][0] for i in idx]), strict=True):
            out[i] = full
    split = [i for i, (_, p) in enumerate(pairs) if getattr(p, "_tp_mode", False)]
    for dtype in {out[i].dtype for i in split}:
        idx = [i for i in split if out[i].dtype == dtype]
        for i, joined in zip(idx, _tp_joined([out[i] for i in idx], [pairs[i][1] for i in idx]), strict=True):
            out[i] = joined
    return out


def _gathered(tensors: list[ShardedTensor]) -> list[torch.Tensor]:
    """The full values of sharded tensors of one shard group and dtype, in one all-gather: each rank sends its
    ranges back to back, and each tensor is joined from every rank's range in rank order (as ``full_tensor``)."""
    layouts = [t.shard_layout for t in tensors]
    comm = layouts[0].buffer.comm
    n = comm.world_size
    if n == 1:
        return [t.to_local().detach().reshape(lay.full_shape).clone() for t, lay in zip(tensors, layouts, strict=True)]
    sizes = [[e - s for s, e in (lay.buffer.slot_source_range(lay.slot, r) for r in range(n))] for lay in layouts]
    piece = max(sum(per_rank[r] for per_rank in sizes) for r in range(n))
    send = torch.zeros(piece, dtype=tensors[0].dtype)
    mine = torch.cat([t.to_local().detach().reshape(-1) for t in tensors])
    send[:mine.numel()].copy_(mine)
    rows = torch.empty(n * piece, dtype=send.dtype)
    comm.all_gather_into(rows, send, label="test: whole tensors")
    rows = rows.view(n, piece)
    offsets, out = [0] * n, []
    for lay, per_rank in zip(layouts, sizes, strict=True):
        parts = []
        for r in range(n):
            parts.append(rows[r, offsets[r]:offsets[r] + per_rank[r]])
            offsets[r] += per_rank[r]
        out.append(torch.cat(parts).view(lay.full_shape))
    return out


def _tp_joined(fulls: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each TP rank's slice ``fulls[i]`` of the split parameter ``params[i]`` joined over the TP group, in one
    all-gather; a strided split (a fused q/k/v) holds each rank's share of every block: joined block by block."""
    from bmt_wrap.job.distributed import parallel_layout

    comm = parallel_layout().tp
    flat = torch.cat([f.contiguous().flatten() for f in fulls])
    out = torch.empty(comm.world_size * flat.numel(), dtype=flat.dtype)
    comm.all_gather_into(out, flat, label="test: whole TP tensor")
    rows, start, joined = out.view(comm.world_size, flat.numel()), 0, []
    for full, param in zip(fulls, params, strict=True):
        slices = [row[start:start + full.numel()].view(full.shape) for row in rows]
        start += full.numel()
        dim = param._tp_split_dim
        blocks = [s.chunk(getattr(param, "_tp_split_parts", 1), dim=dim) for s in slices]
        joined.append(torch.cat([b[j] for j in range(len(blocks[0])) for b in blocks], dim=dim))
    return joined


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """SGD(0.1); AdamW; or AdamW with the weight-decay groups of a well-known training script: "adamw_groups"
    and "nanogpt" (nanoGPT's configure_optimizers: decay where ``p.dim() >= 2``), "timm" (timm's
    param_groups_weight_decay: no decay where ``p.ndim <= 1`` or the name ends in ``.bias``)."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return torch.optim.AdamW(decay_groups(kind, model, 0.1), lr=1e-3)


def decay_groups(style: str, model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Param groups as the script named by ``style`` builds them (written from their published rules)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if style == "timm":
        no_decay = [p for n, p in named if p.ndim <= 1 or n.endswith(".bias")]
        decay = [p for n, p in named if not (p.ndim <= 1 or n.endswith(".bias"))]
        return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _check(failures: list[str] | None, check: Callable[[], None]) -> None:
    """Run an assertion; with a ``failures`` list, record its message there instead of raising."""
    if failures is None:
        check()
        return
    try:
        check()
    except AssertionError as exc:
        failures.append(str(exc))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference; NaN anywhere counts as infinite."""
    if not a.numel():
        return 0.0
    return float(torch.nan_to_num((a.float() - b.float()).abs(), nan=float("inf")).max())


def compare_params(ref: nn.Module, model: nn.Module, optimizer: str, what: str,
                   noise_only: frozenset[str] = frozenset(), failures: list[str] | None = None) -> float:
    """Assert the wrapped model's parameters, read whole, equal the reference's; returns the largest difference.

    ``noise_only``: parameters whose exact gradient is zero (an attention key bias: softmax ignores it),
    so the reference's gradient is rounding noise that Adam turns into lr-sized steps; under AdamW they
    cannot be compared by any implementation and are left to the SGD runs, which check them exactly.
    ``failures``: record violations there instead of raising.
    """
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    named = list(model.named_parameters())
    for (name, _), value in zip(named, wholes([(p, p) for _, p in named]), strict=True):
        if optimizer != "sgd" and name in noise_only:
            continue
        want = ref_params[name].detach()
        if optimizer == "sgd":
            _check(failures, lambda value=value, want=want, name=name: torch.testing.assert_close(
                value, want, **SGD_TOL, msg=lambda m: f"{what} {name}: {m}"))
        elif want.numel():
            rel = float((value - want).norm() / want.norm().clamp_min(1e-12))

            def within(rel: float = rel, name: str = name) -> None:
                assert rel <= ADAMW_REL, f"{what} {name}: relative difference {rel:.2e} > {ADAMW_REL}"
            _check(failures, within)
        worst = max(worst, _max_abs(value, want))
    return worst


def compare_grads(ref: nn.Module, model: nn.Module, what: str, failures: list[str] | None = None) -> float:
    """Assert every ``.grad``, read whole, is the reference gradient (None where the reference's is).

    ``failures``: record violations there instead of raising.
    """
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    both = []
    for name, p in model.named_parameters():
        rp = ref_params[name]
        if rp.grad is not None and p.grad is not None:
            both.append((name, p))
        elif rp.grad is not None or p.grad is not None:
            msg = (f"{what} {name}: reference has no gradient but the shard has one" if rp.grad is None
                   else f"{what} {name}: the shard has no gradient")
            if failures is None:
                raise AssertionError(msg)
            failures.append(msg)
            worst = float("inf")
    for (name, _), grad in zip(both, wholes([(p.grad, p) for _, p in both]), strict=True):
        rp = ref_params[name]
        _check(failures, lambda grad=grad, want=rp.grad, name=name: torch.testing.assert_close(
            grad, want, **SGD_TOL, msg=lambda m: f"{what} grad {name}: {m}"))
        worst = max(worst, _max_abs(grad, rp.grad))
    return worst


def compare_buffers(ref: nn.Module, model: nn.Module, what: str, failures: list[str] | None = None) -> float:
    """Assert every buffer of the wrapped model equals the reference's (running statistics, counters)."""
    ref_buffers = dict(ref.named_buffers(remove_duplicate=False))
    worst = 0.0
    for name, b in model.named_buffers(remove_duplicate=False):
        rb = ref_buffers.get(name)
        if rb is None or rb.shape != b.shape:
            continue
        if b.is_floating_point():
            _check(failures, lambda b=b, rb=rb, name=name: torch.testing.assert_close(
                b, rb, **SGD_TOL, msg=lambda m: f"{what} buffer {name}: {m}"))
        else:
            def same(b: torch.Tensor = b, rb: torch.Tensor = rb, name: str = name) -> None:
                assert torch.equal(b, rb), f"{what} buffer {name}: {b.flatten()[:4].tolist()} != {rb.flatten()[:4].tolist()}"
            _check(failures, same)
        worst = max(worst, _max_abs(b, rb))
    return worst


def train_side_by_side(build: Callable[[], nn.Module], wrap: Callable[[nn.Module], nn.Module],
                       batches: list[tuple[torch.Tensor, ...]], *, optimizer: str = "sgd", micro: int = 1,
                       two_forwards: bool = False, check_grads: bool = True,
                       loss_fn: Callable[..., torch.Tensor] | None = None, strict: bool = True,
                       sliced_reference: bool = False, reseed: int | None = None,
                       check_buffers: bool = False,
                       data_parallel: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train reference and sharded copies on ``batches`` (global batches); assert parity each step.

    ``strict=False``: record violations in ``result["failures"]`` and keep training (every rank runs the
    same collectives whatever it finds). ``sliced_reference``: the reference runs each rank's slice in turn
    (gradients averaged; its buffers end as this rank's slice left them). ``reseed``: seed before each
    model's step, so both draw the same dropout masks. ``check_buffers``: compare buffers after training.
    ``data_parallel``: (rank, size) of the data-parallel group when it is not the world (tensor parallelism:
    TP peers share one slice).
    """
    torch.manual_seed(0)
    ref = build()
    model = wrap(copy.deepcopy(ref))
    ref_opt, opt = make_optimizer(optimizer, ref), make_optimizer(optimizer, model)
    rank, n = data_parallel or (bmt.rank(), bmt.world_size())
    failures: list[str] | None = None if strict else []
    losses, ref_losses, grad_diff = [], [], 0.0
    grad_peak: dict[str, float] = {}
    for step, batch in enumerate(batches):
        local = tuple(t.chunk(n)[rank] for t in batch)
        if reseed is not None:
            torch.manual_seed(reseed + step)
        if sliced_reference:
            ref_loss = _sliced_step_loss(ref, batch, rank, n, micro, two_forwards, loss_fn)
        else:
            ref_loss = _step_loss(ref, batch, micro, two_forwards, loss_fn)
        if reseed is not None:
            torch.manual_seed(reseed + step)
        loss = _step_loss(model, local, micro, two_forwards, loss_fn)
        ref_losses.append(float(ref_loss))
        losses.append(float(bmt.sum_loss(loss)))
        if check_grads:
            grad_diff = max(grad_diff, compare_grads(ref, model, f"step {step}", failures))
        for name, rp in ref.named_parameters(remove_duplicate=False):
            if rp.grad is not None:
                peak = float(rp.grad.abs().max()) if rp.grad.numel() else 0.0
                grad_peak[name] = max(grad_peak.get(name, 0.0), peak)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        _check(failures, lambda step=step: torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0,
            msg=lambda m: f"losses differ at step {step}: {m}"))
    noise_only = frozenset(n for n, g in grad_peak.items() if g < NOISE_GRAD)
    param_diff = compare_params(ref, model, optimizer, "after training", noise_only, failures)
    buffer_diff = compare_buffers(ref, model, "after training", failures) if check_buffers else 0.0
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), default=0.0)
    return {"losses": losses, "ref_losses": ref_losses, "grad_diff": grad_diff, "param_diff": param_diff,
            "loss_diff": loss_diff, "buffer_diff": buffer_diff, "failures": failures or [],
            "comm": bmt.comm_stats()}


def _step_loss(model: nn.Module, batch: tuple[torch.Tensor, ...], micro: int, two_forwards: bool,
               loss_fn: Callable[..., torch.Tensor] | None, scale: float = 1.0) -> torch.Tensor:
    run = loss_fn or (lambda m, *b: m(*b))
    total = torch.zeros(())
    for chunk in zip(*(t.chunk(micro) for t in batch), strict=True):
        if two_forwards:
            halves = list(zip(*(t.chunk(2) for t in chunk), strict=True))
            loss = (run(model, *halves[0]) + run(model, *halves[1])) / 2
        else:
            loss = run(model, *chunk)
        (loss / micro if scale == 1.0 else loss * scale / micro).backward()
        total = total + loss.detach() / micro
    return total


def _sliced_step_loss(ref: nn.Module, batch: tuple[torch.Tensor, ...], rank: int, n: int, micro: int,
                      two_forwards: bool, loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """The data-parallel reference in one process: each rank's slice in turn, gradients averaged; the
    buffers end as this rank's slice left them (each rank's running statistics are its own)."""
    start = {name: b.detach().clone() for name, b in ref.named_buffers()}
    mine: dict[str, torch.Tensor] = {}
    total = torch.zeros(())
    for r in range(n):
        with torch.no_grad():
            for name, b in ref.named_buffers():
                b.copy_(start[name])
        local = tuple(t.chunk(n)[r] for t in batch)
        total = total + _step_loss(ref, local, micro, two_forwards, loss_fn, scale=1.0 / n) / n
        if r == rank:
            mine = {name: b.detach().clone() for name, b in ref.named_buffers()}
    with torch.no_grad():
        for name, b in ref.named_buffers():
            b.copy_(mine[name])
    return total


def no_sync_two_halves(model: nn.Module, ref: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], dp: int,
                       n: int) -> None:
    """Backward this dp rank's half-batches through ``model``, the first under ``no_sync()``, and every dp
    rank's through ``ref``, averaged over the ``n`` dp ranks: the gradients plain accumulation gives."""
    ids, tgt = (t.chunk(n)[dp] for t in batch)
    with model.no_sync():
        (model(ids[:2], tgt[:2]) / 2).backward()
    (model(ids[2:], tgt[2:]) / 2).backward()
    for r in range(n):
        rids, rtgt = (t.chunk(n)[r] for t in batch)
        (ref(rids[:2], rtgt[:2]) / 2 / n).backward()
        (ref(rids[2:], rtgt[2:]) / 2 / n).backward()


def lm_batches(steps: int, batch: int, seq: int = 8, vocab: int = 64, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Deterministic token batches (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def train_managed(model: nn.Module, mgr: Any, batches: list[tuple[torch.Tensor, ...]], steps: range) -> list[float]:
    """``steps`` of ``batches`` through an ``OptimManager``, each data-parallel rank on its slice (the stages of
    a pipeline on the same one); the rank-mean losses."""
    import bmt_wrap as bmt

    n, r = bmt.data_parallel_size(), bmt.data_parallel_rank()
    losses = []
    for step in steps:
        idx, tgt = batches[step]
        loss = model(idx.chunk(n)[r], tgt.chunk(n)[r])
        mgr.backward(loss)
        mgr.step()
        mgr.zero_grad()
        losses.append(float(bmt.sum_loss(loss)))
    return losses

