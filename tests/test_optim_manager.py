"""OptimManager: loss scaling, overflow skipped on every rank, clipping of sharded gradients, accumulation."""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed
from kernel_checks.reference import ReferenceAdamW, assert_within_one_rounding

import bmt_wrap as bmt
from bmt_wrap.dtypes import align_elems
from bmt_wrap.errors import OptimizerError
from bmt_wrap.lr_scheduler import NoDecay
from bmt_wrap.optim import (
    REPLICATED_ATTR,
    AdamOptimizer,
    OptimManager,
    clip_grad_norm_,
    grad_norm,
    install_grad_scaler_guard,
)

SHAPES = [(7, 5), (5,), (3, 4), (9,)]


# ---- a simulated shard: what the engine gives each rank ---------------------------------------------------
def _full(kind: str, step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed({"param": 1, "grad": 2}[kind] * 1000 + step)  # identical on every rank
    return [torch.randn(s, generator=g) for s in SHAPES]


class _Shard:
    """Rank ``rank``'s slice of the flattened, aligned, padded parameters: 1-D views of one flat buffer."""

    def __init__(self, full: list[torch.Tensor], rank: int, world: int, dtype: torch.dtype) -> None:
        align, offsets, pos = align_elems(dtype), [], 0
        for t in full:
            offsets.append(pos)
            pos += -(-t.numel() // align) * align
        size = -(-pos // world)
        lo, hi = rank * size, (rank + 1) * size
        self.flat = torch.zeros(size, dtype=dtype)
        self.grad = torch.zeros(size, dtype=dtype)
        self.slices: list[tuple[int, int, int, int]] = []  # local [a, b) <- flattened original [s, e)
        self.params: list[torch.nn.Parameter] = []
        for t, off in zip(full, offsets, strict=True):
            a, b = max(off, lo), min(off + t.numel(), hi)
            a, b = (a, b) if a < b else (lo, lo)
            self.slices.append((a - lo, b - lo, a - off, b - off))
            self.flat[a - lo:b - lo] = t.reshape(-1)[a - off:b - off].to(dtype)
            p = torch.nn.Parameter(self.flat[a - lo:b - lo])
            p.full_shape = t.shape
            self.params.append(p)

    def local(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's slices of full tensors."""
        return [t.reshape(-1)[s:e] for t, (_, _, s, e) in zip(full, self.slices, strict=True)]

    def set_grads(self, full: list[torch.Tensor]) -> None:
        self.grad.zero_()
        for p, piece, (a, b, _, _) in zip(self.params, self.local(full), self.slices, strict=True):
            self.grad[a:b] = piece.to(self.grad.dtype)
            p.grad = self.grad[a:b]


# ---- clipping equals torch's on the unsharded model --------------------------------------------------------
def _clip_body(norm_type: float, loss_scale: float | None) -> float:
    state = bmt.get_state()
    full_grads = [g * 3 for g in _full("grad")]
    shard = _Shard(_full("param"), state.rank, state.world_size, torch.float32)
    scale = loss_scale or 1.0
    shard.set_grads([g * scale for g in full_grads])
    replicated = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(9)))
    setattr(replicated, REPLICATED_ATTR, True)
    replicated.grad = torch.linspace(-2, 3, 6) * scale

    opt = AdamOptimizer(shard.params + [replicated])
    mgr = OptimManager(loss_scale=loss_scale)
    mgr.add_optimizer(opt)
    bmt.reset_comm_stats()
    norm = mgr.clip_grad_norm(opt.param_groups, 1.0, norm_type)
    calls = bmt.comm_stats().get("all_reduce", {}).get("calls", 0)
    assert calls == (1 if state.world_size > 1 else 0), f"one all-reduce for the global norm, got {calls}"

    ref = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES] + [torch.nn.Parameter(torch.zeros(6))]
    for r, g in zip(ref, full_grads + [torch.linspace(-2, 3, 6)], strict=True):
        r.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for p, piece in zip(shard.params, shard.local([r.grad for r in ref[:-1]]), strict=True):
        torch.testing.assert_close(p.grad / scale, piece, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(replicated.grad / scale, ref[-1].grad, rtol=1e-5, atol=1e-7)

    again = mgr.clip_grad_norm(max_norm=1.0, norm_type=norm_type)  # every managed group
    torch.testing.assert_close(again, torch.tensor(1.0), rtol=1e-4, atol=0)
    for p in opt.param_groups[0]["params"]:
        p.grad.mul_(4.0)
    once_more = clip_grad_norm_(opt.param_groups[0]["params"], 2.0, norm_type)  # stored gradients carry the scale
    torch.testing.assert_close(once_more, torch.tensor(4.0 * scale), rtol=1e-4, atol=0)
    return float(norm)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_clip_matches_torch_on_unsharded_model(world_size: int, norm_type: float) -> None:
    norms = run_distributed(_clip_body, world_size, norm_type, 8.0 if world_size == 2 else None)
    assert len(set(norms)) == 1, "every rank gets the same norm"


# ---- overflow on one rank: skipped everywhere -------------------------------------------------------------
def _overflow_body(bad_step: int, bad_rank: int) -> list[tuple[bool, float]]:
    state = bmt.get_state()
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    full = [t.half() for t in _full("param")]
    shard = _Shard(full, state.rank, state.world_size, torch.float16)
    opt = AdamOptimizer(shard.params, **hyper)
    scheduler = NoDecay(opt, start_lr=1e-2, warmup_iter=0, end_iter=100)
    mgr = OptimManager(loss_scale=2.0 ** 10, loss_scale_steps=3)
    mgr.add_optimizer(opt, scheduler)
    ref = ReferenceAdamW(full, [(list(range(len(full))), hyper)])
    history = []
    for step in range(7):
        scaled = [(g * mgr.loss_scale).half() for g in _full("grad", step)]
        shard.set_grads(scaled)
        if step == bad_step and state.rank == bad_rank:
            shard.grad[0] = math.inf
        before = [p.detach().clone() for p in shard.params], [
            {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in shard.params]
        scale_before, iters_before = mgr.loss_scale, scheduler.num_iter
        bmt.reset_comm_stats()
        stepped = mgr.step()
        assert bmt.comm_stats()["all_reduce"]["calls"] == 1, "one all-reduce for the overflow flag"
        history.append((stepped, mgr.loss_scale))
        if step == bad_step:
            assert not stepped and mgr.loss_scale == scale_before / 2 and scheduler.num_iter == iters_before
            for p, old_p, old_state in zip(shard.params, *before, strict=True):
                assert torch.equal(p.detach(), old_p)
                assert all(torch.equal(opt.state[p][k], v) for k, v in old_state.items())
        else:
            assert stepped
            ref.step([g.double() / scale_before for g in scaled])
    for p, piece in zip(shard.params, shard.local([r.detach() for r in ref.params]), strict=True):
        torch.testing.assert_close(opt.state[p]["master"].double(), piece, rtol=1e-5, atol=1e-7)
        assert_within_one_rounding(p.detach(), piece)
    return history


@pytest.mark.parametrize("world_size", [2, 4])
def test_overflow_on_one_rank_is_skipped_on_every_rank(world_size: int) -> None:
    histories = run_distributed(_overflow_body, world_size, 2, world_size - 1)
    assert all(h == histories[0] for h in histories)
    assert [s for s, _ in histories[0]] == [True, True, False, True, True, True, True]
    assert [scale for _, scale in histories[0]] == [1024, 1024, 512, 512, 512, 1024, 1024]


# ---- GradScaler on sharded gradients is refused ------------------------------------------------------------
def _grad_scaler_body() -> bool:
    state = bmt.get_state()
    shard = _Shard(_full("param"), state.rank, state.world_size, torch.float32)
    shard.set_grads(_full("grad"))
    install_grad_scaler_guard()
    for opt in (AdamOptimizer(shard.params), torch.optim.SGD(shard.params, lr=0.1)):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        with pytest.raises(OptimizerError, match="OptimManager"):
            scaler.step(opt)
    return True


def test_grad_scaler_on_sharded_parameters_raises() -> None:
    assert run_distributed(_grad_scaler_body, 2) == [True, True]


def test_grad_scaler_on_one_process_is_allowed() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.full_shape = p.shape
    p.grad = torch.ones(3)
    opt = AdamOptimizer([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    assert not torch.equal(p.detach(), torch.ones(3))


# ---- one process: schedule, accumulation, unused parameters, foreign optimizers ----------------------------
def test_loss_scale_schedule() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    mgr = OptimManager(loss_scale=8, loss_scale_factor=0.5, loss_scale_steps=2, min_loss_scale=2, max_loss_scale=16)
    mgr.add_optimizer(AdamOptimizer([p]))
    scales = []
    for grad in [1, 1, 1, 1, 1, math.nan, math.inf, math.inf, 1, 1]:
        p.grad = torch.full((4,), float(grad))
        mgr.step()
        scales.append(mgr.loss_scale)
    assert scales == [8, 16, 16, 16, 16, 8, 4, 2, 2, 4]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def test_accumulation_equals_one_big_batch() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    models = [_model(), _model()]
    managers = []
    for m in models:
        mgr = OptimManager(loss_scale=64)
        mgr.add_optimizer(AdamOptimizer(m.parameters(), lr=1e-2, weight_decay=0.1))
        managers.append(mgr)
    for _ in range(3):
        for mgr in managers:
            mgr.zero_grad()
        managers[0].backward(torch.nn.functional.mse_loss(models[0](x), y))
        for half in (slice(0, 4), slice(4, 8)):
            managers[1].backward(torch.nn.functional.mse_loss(models[1](x[half]), y[half]) / 2)
        assert managers[0].step() and managers[1].step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unused_parameters_are_untouched() -> None:
    model = _model()
    unused = torch.nn.Linear(3, 3)
    before = [t.detach().clone() for t in unused.parameters()]
    opt = AdamOptimizer(list(model.parameters()) + list(unused.parameters()), lr=0.1, weight_decay=0.5)
    mgr = OptimManager()
    mgr.add_optimizer(opt)
    for _ in range(2):
        mgr.zero_grad()
        mgr.backward(model(torch.randn(2, 4)).sum())
        mgr.step()
    assert all(torch.equal(a, b) for a, b in zip(unused.parameters(), before, strict=True))
    assert all(p not in opt.state for p in unused.parameters())


def test_foreign_optimizer_gets_unscaled_gradients() -> None:
    a, b = _model(), _model()
    mgr = OptimManager(loss_scale=1024)
    mgr.add_optimizer(torch.optim.SGD(a.parameters(), lr=0.1))
    plain = torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    mgr.backward(a(x).pow(2).mean())
    b(x).pow(2).mean().backward()
    mgr.step()
    plain.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clip_leaves_non_finite_gradients_for_the_overflow_check() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, math.inf, 2.0])
    mgr = OptimManager(loss_scale=4)
    mgr.add_optimizer(AdamOptimizer([p]))
    assert math.isinf(mgr.clip_grad_norm(1.0))
    assert torch.equal(p.grad, torch.tensor([1.0, math.inf, 2.0]))
    assert not mgr.step() and torch.equal(p.detach(), torch.zeros(3))


def test_low_precision_norm_matches_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grad_norm, "SCRATCH_ELEMS", 7)  # convert in many slices, as a large shard does
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in SHAPES]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, r, g in zip(params, ref, _full("grad"), strict=True):
        p.grad = g.bfloat16()
        r.grad = p.grad.float()
    mgr = OptimManager()
    mgr.add_optimizer(AdamOptimizer(params))
    norm = mgr.clip_grad_norm(max_norm=1.0)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref, 1.0), rtol=1e-5, atol=0)
    for p, r in zip(params, ref, strict=True):
        assert_within_one_rounding(p.grad, r.grad.double())


def test_clip_argument_errors() -> None:
    mgr = OptimManager()
    mgr.add_optimizer(AdamOptimizer([torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(OptimizerError, match="max_norm"):
        mgr.clip_grad_norm()
    with pytest.raises(OptimizerError, match="norm_type"):
        mgr.clip_grad_norm(max_norm=1.0, norm_type=0)


def test_manager_state_dict_round_trip() -> None:
    def build(model: torch.nn.Module) -> tuple[OptimManager, NoDecay]:
        opt = AdamOptimizer(model.parameters(), lr=1e-2)
        scheduler = NoDecay(opt, start_lr=1e-2, warmup_iter=4, end_iter=100)
        mgr = OptimManager(loss_scale=256, loss_scale_steps=2)
        mgr.add_optimizer(opt, scheduler)
        return mgr, scheduler

    def train(model: torch.nn.Module, mgr: OptimManager, steps: int) -> None:
        for i in range(steps):
            mgr.zero_grad()
            mgr.backward(model(torch.full((3, 4), float(i))).pow(2).mean())
            mgr.step()

    a, b = _model(), _model()
    mgr_a, sched_a = build(a)
    train(a, mgr_a, 3)
    mgr_b, sched_b = build(b)
    mgr_b.load_state_dict(mgr_a.state_dict())
    b.load_state_dict(a.state_dict())
    assert mgr_b.loss_scale == mgr_a.loss_scale == 512 and sched_b.num_iter == 3
    train(a, mgr_a, 3)
    train(b, mgr_b, 3)
    assert mgr_b.loss_scale == mgr_a.loss_scale and sched_b.current_lr == sched_a.current_lr
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(OptimizerError, match="loss scaling"):
        OptimManager().load_state_dict(dict(mgr_a.state_dict(), optimizers=[]))
