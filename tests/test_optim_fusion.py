"""Fused-run detection: views of one flat buffer update in one call, with results identical to per-tensor updates."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from bmt_wrap.dtypes import align_elems
from bmt_wrap.optim import AdamOptimizer, fusion, plan_runs, torch_adam


def _flat_views(numels: list[int], dtype: torch.dtype = torch.float32, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.nn.Parameter]]:
    """An engine-like shard: parameters at aligned offsets of one buffer, gradients likewise, gaps zero."""
    align = align_elems(dtype)
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-n // align) * align
    g = torch.Generator().manual_seed(seed)
    flat, grad = torch.zeros(pos, dtype=dtype), torch.zeros(pos, dtype=dtype)
    params = []
    for off, n in zip(offsets, numels, strict=True):
        flat[off:off + n] = torch.randn(n, generator=g).to(dtype)
        p = torch.nn.Parameter(flat[off:off + n])
        p.grad = grad[off:off + n]
        params.append(p)
    return flat, grad, params


def _fill_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        if p.grad is not None:
            p.grad.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


def test_three_adjacent_views_are_one_run() -> None:
    flat, grad, params = _flat_views([10, 50, 7])
    items = [(p, p.grad) for p in params]
    runs = plan_runs(items, [0, 0, 0])
    assert len(runs) == 1 and runs[0].members == (0, 1, 2)
    p_view, g_view = runs[0].views(items)
    assert p_view.data_ptr() == flat.data_ptr() and g_view.data_ptr() == grad.data_ptr()
    assert p_view.numel() == params[2].storage_offset() + 7
    opt = AdamOptimizer(params, lr=0.1, weight_decay=0.1)
    opt.step()
    assert opt.last_step_runs == 1
    state_storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params}
    assert len(state_storages) == 1, "state mirrors the flat layout, so it fuses too"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_equals_per_tensor_bit_for_bit(dtype: torch.dtype) -> None:
    numels = [33, 128, 5, 77]
    flat, _, fused = _flat_views(numels, dtype)
    loose = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    groups = lambda ps: [dict(params=ps[:3], weight_decay=0.1), dict(params=ps[3:], lr=3e-3)]  # noqa: E731
    opt_fused, opt_loose = AdamOptimizer(groups(fused), lr=1e-2), AdamOptimizer(groups(loose), lr=1e-2)
    for step in range(6):
        _fill_grads(fused, step)
        for a, b in zip(loose, fused, strict=True):
            a.grad = b.grad.clone()
        opt_fused.step(scale=4.0)
        opt_loose.step(scale=4.0)
        assert opt_fused.last_step_runs == 2 and opt_loose.last_step_runs == 4
        for a, b in zip(loose, fused, strict=True):
            assert torch.equal(a, b)
    gaps = torch.ones_like(flat, dtype=torch.bool)
    for p in fused:
        gaps[p.storage_offset():p.storage_offset() + p.numel()] = False
    assert not flat[gaps].any(), "alignment gaps stay zero"


def test_gradient_none_splits_the_run_and_is_untouched() -> None:
    _, _, params = _flat_views([16, 16, 16, 16])
    opt = AdamOptimizer(params, lr=0.1)
    opt.step()
    params[1].grad = None
    before = params[1].detach().clone(), opt.state[params[1]]["exp_avg"].clone()
    opt.step()
    assert opt.last_step_runs == 2
    assert torch.equal(params[1].detach(), before[0]) and torch.equal(opt.state[params[1]]["exp_avg"], before[1])


def test_equal_hyperparameters_in_different_groups_still_fuse() -> None:
    _, _, params = _flat_views([40, 40, 40])
    opt = AdamOptimizer([dict(params=params[:1]), dict(params=params[1:2], weight_decay=0.5), dict(params=params[2:])])
    opt.step()
    assert opt.last_step_runs == 3, "the middle group differs, so it splits the buffer"
    opt.param_groups[1]["weight_decay"] = 0.0
    opt.step()
    assert opt.last_step_runs == 1


def test_what_must_not_fuse() -> None:
    flat = torch.randn(100)
    grad = torch.randn(100)
    overlapping = [(flat[0:20], grad[0:20]), (flat[10:30], grad[10:30])]
    assert len(plan_runs(overlapping, [0, 0])) == 2
    nonzero_gap = [(flat[0:20], grad[0:20]), (flat[24:40], grad[24:40])]
    assert len(plan_runs(nonzero_gap, [0, 0])) == 2, "gap memory that is not zero belongs to someone else"
    shifted_grad = [(flat[0:20], grad[0:20]), (flat[20:40], grad[30:50])]
    assert len(plan_runs(shifted_grad, [0, 0])) == 2
    separate = [(torch.zeros(4), torch.zeros(4)), (torch.zeros(4), torch.zeros(4))]
    assert len(plan_runs(separate, [0, 0])) == 2
    big_gap = torch.zeros(1000)
    far = [(big_gap[0:10], big_gap[0:10]), (big_gap[500:510], big_gap[500:510])]
    assert len(plan_runs(far, [0, 0])) == 2
    adjacent = [(flat[0:20], grad[0:20]), (flat[20:40], grad[20:40])]
    assert len(plan_runs(adjacent, [0, 0])) == 1 and len(plan_runs(adjacent, [0, 1])) == 2


def test_empty_and_strided_parameters() -> None:
    strided = torch.nn.Parameter(torch.randn(6, 4).t())
    empty = torch.nn.Parameter(torch.zeros(0))
    plain = torch.nn.Parameter(torch.randn(5))
    params = [strided, empty, plain]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = AdamOptimizer(params, lr=0.1, weight_decay=0.1), torch.optim.AdamW(refs, lr=0.1, weight_decay=0.1)
    for _ in range(3):
        for p, r in zip(params, refs, strict=True):
            p.grad = torch.randn(p.shape).t().contiguous().t() if p.dim() == 2 else torch.randn(p.shape)
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert strided.stride() == (1, 4)


def test_cached_plans_do_not_keep_gradients_alive() -> None:
    _, _, params = _flat_views([8, 8])
    opt = AdamOptimizer(params)
    for _ in range(3):
        grad = torch.zeros(64)
        for p in params:
            p.grad = grad[p.storage_offset():p.storage_offset() + p.numel()]
        opt.step()
        watch = weakref.ref(grad)
        del grad
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert watch() is None
        assert opt.last_step_runs == 1


def test_scratch_slices_spanning_ranges_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    for scratch in (torch_adam.SCRATCH_ELEMS, 50):  # 50: every range is cut, and slices mix ranges
        monkeypatch.setattr(torch_adam, "SCRATCH_ELEMS", scratch)
        _, _, params = _flat_views([33, 128, 5, 77], torch.bfloat16)
        loose = torch.nn.Parameter(torch.randn(9, 11, generator=torch.Generator().manual_seed(5)).bfloat16())
        opt = AdamOptimizer([dict(params=params + [loose], lr=1e-2)])
        for step in range(3):
            _fill_grads(params, step)
            loose.grad = torch.full_like(loose, 0.5 - step)
            opt.step(scale=2.0)
        results.append([p.detach().clone() for p in params + [loose]] + [opt.state[loose]["master"].clone()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_changing_learning_rate_does_not_replan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_plan = fusion.plan_runs
    monkeypatch.setattr(fusion, "plan_runs", lambda *a: calls.append(1) or real_plan(*a))
    _, _, params = _flat_views([16, 16, 16])
    opt = AdamOptimizer([dict(params=params[:2]), dict(params=params[2:], weight_decay=0.1)])
    for step in range(5):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        opt.step()
    assert len(calls) == 1 and opt.last_step_runs == 2
