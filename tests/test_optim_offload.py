"""AdamOffloadOptimizer: its own host state, and results equal to AdamOptimizer's."""

from __future__ import annotations

import pytest
import torch

from bmt_wrap.optim import AdamOffloadOptimizer, AdamOptimizer


def _twins(dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(3)
    flat = torch.zeros(256, dtype=dtype)
    flat[:100] = torch.randn(100, generator=g).to(dtype)
    flat[128:200] = torch.randn(72, generator=g).to(dtype)
    a = [torch.nn.Parameter(flat[:100]), torch.nn.Parameter(flat[128:200]), torch.nn.Parameter(torch.randn(3, 4).to(dtype))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_offload_equals_in_memory(dtype: torch.dtype) -> None:
    mem, off = _twins(dtype)
    groups = lambda ps: [dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:], lr=2e-3)]  # noqa: E731
    opt_mem, opt_off = AdamOptimizer(groups(mem), lr=1e-2), AdamOffloadOptimizer(groups(off), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        for a, b in zip(mem, off, strict=True):
            a.grad = (torch.randn(a.shape, generator=g) * 16).to(dtype)
            b.grad = a.grad.clone()
        opt_mem.step(scale=16.0)
        opt_off.step(scale=16.0)
    for a, b in zip(mem, off, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_mem.state[a][key], opt_off.state[b][key])


def test_offload_state_is_its_own_host_memory() -> None:
    _, params = _twins(torch.float32)
    opt = AdamOffloadOptimizer(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    for p in params:
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "master"}, "every dtype keeps a master copy"
        for key in ("exp_avg", "exp_avg_sq", "master"):
            t = state[key]
            assert t.device.type == "cpu" and t.dtype == torch.float32
            assert t.untyped_storage().data_ptr() not in param_storages
            assert t.is_pinned() == torch.cuda.is_available()
        assert torch.equal(state["master"], p.detach())
