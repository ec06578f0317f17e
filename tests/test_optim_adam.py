"""AdamOptimizer against a float64 torch.optim.AdamW reference: dtypes, param groups, hold steps, checkpoints."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_checks.reference import ReferenceAdamW, assert_within_one_rounding

from bmt_wrap.errors import OptimizerError
from bmt_wrap.optim import AdamOptimizer

LOW = [torch.bfloat16, torch.float16]


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params: list[torch.Tensor], step: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return [(torch.randn(p.shape, generator=g) * (0.1 + 0.05 * step)).to(p.dtype) for p in params]


def _run(params: list[torch.nn.Parameter], groups: list[tuple[list[int], dict]], steps: int, seed: int = 0,
         check: object = None) -> tuple[AdamOptimizer, ReferenceAdamW]:
    opt = AdamOptimizer([dict(params=[params[i] for i in idx], **hyper) for idx, hyper in groups])
    ref = ReferenceAdamW(params, groups)
    for step in range(1, steps + 1):
        grads = _grads(params, step, seed)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
        if check is not None:
            check(opt, ref)
    return opt, ref


GROUPS = [([0, 1], dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
          ([2], dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0))]
SHAPES = [(13, 7), (31,), (4, 5, 6)]


def test_fp32_matches_adamw_every_step() -> None:
    def check(opt: AdamOptimizer, ref: ReferenceAdamW) -> None:
        for p, r in zip(params, ref.params, strict=True):
            torch.testing.assert_close(p.detach().double(), r.detach(), rtol=1e-5, atol=1e-7)
            state, rstate = opt.state[p], ref.opt.state[r]
            assert "master" not in state, "fp32 parameters are updated in place"
            torch.testing.assert_close(state["exp_avg_sq"].double(), rstate["exp_avg_sq"], rtol=1e-5, atol=1e-12)

    params = _params(SHAPES, torch.float32)
    _run(params, GROUPS, steps=20, check=check)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_keeps_fp32_master(dtype: torch.dtype) -> None:
    def check(opt: AdamOptimizer, ref: ReferenceAdamW) -> None:
        for p, r in zip(params, ref.params, strict=True):
            state = opt.state[p]
            assert state["master"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
            torch.testing.assert_close(state["master"].double(), r.detach(), rtol=1e-5, atol=1e-7)
            assert torch.equal(p.detach(), state["master"].to(dtype)), "the parameter is the master's rounding"
            assert_within_one_rounding(p.detach(), r.detach())

    params = _params(SHAPES, dtype)
    _run(params, GROUPS, steps=20, check=check)


@given(shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4),
       lr=st.floats(1e-4, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       weight_decay=st.floats(0.0, 0.5), split=st.integers(0, 4), flat=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_property_matches_adamw(shapes: list[tuple[int, ...]], lr: float, beta1: float, beta2: float,
                                weight_decay: float, split: int, flat: bool, dtype: torch.dtype) -> None:
    params = _params(shapes, dtype, seed=len(shapes))
    if flat:  # views of one flat buffer with alignment gaps, as the engine lays out a shard
        buf = torch.zeros(sum(p.numel() + 64 for p in params), dtype=dtype)
        views, pos = [], 0
        for p in params:
            view = buf[pos:pos + p.numel()].view(p.shape)
            view.copy_(p.detach())
            views.append(torch.nn.Parameter(view))
            pos += p.numel() + 64 - p.numel() % 64
        params = views
    split = min(split, len(params))
    groups = [(list(range(split)), dict(lr=lr, betas=(beta1, beta2), eps=1e-8, weight_decay=weight_decay)),
              (list(range(split, len(params))), dict(lr=lr / 2, betas=(beta1, beta2), eps=1e-8, weight_decay=0.0))]
    groups = [g for g in groups if g[0]]
    opt, ref = _run(params, groups, steps=4, seed=split)
    for p, r in zip(params, ref.params, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(p.detach().double(), r.detach(), rtol=1e-5, atol=1e-7)
        else:
            torch.testing.assert_close(opt.state[p]["master"].double(), r.detach(), rtol=1e-5, atol=1e-7)
            assert_within_one_rounding(p.detach(), r.detach())


def test_parameter_without_gradient_is_untouched() -> None:
    params = _params(SHAPES, torch.bfloat16)
    opt = AdamOptimizer(params, lr=1e-2, weight_decay=0.1)
    ref = ReferenceAdamW(params, [([0, 1, 2], dict(lr=1e-2, weight_decay=0.1))])
    for step in range(1, 6):
        grads: list[torch.Tensor | None] = list(_grads(params, step))
        if step in (2, 3):
            grads[1] = None
        before = (params[1].detach().clone(), opt.state[params[1]].get("exp_avg", torch.empty(0)).clone())
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        ref.step(grads)
        if grads[1] is None:
            assert torch.equal(params[1].detach(), before[0]) and torch.equal(opt.state[params[1]]["exp_avg"], before[1])
    assert opt.state[params[1]]["step"] == 3 and opt.state[params[0]]["step"] == 5
    for p, r in zip(params, ref.params, strict=True):
        torch.testing.assert_close(opt.state[p]["master"].double(), r.detach(), rtol=1e-5, atol=1e-7)


def test_hold_steps_keep_parameters_while_moments_accumulate() -> None:
    params = _params([(20,)], torch.float32)
    start = params[0].detach().clone()
    opt = AdamOptimizer(params, lr=1e-2, weight_decay=0.1, hold_steps=2)
    for step in (1, 2):
        params[0].grad = _grads(params, step)[0]
        opt.step()
        assert torch.equal(params[0].detach(), start)
    assert opt.state[params[0]]["exp_avg"].abs().sum() > 0
    params[0].grad = _grads(params, 3)[0]
    opt.step()
    assert not torch.equal(params[0].detach(), start)


def _train(opt: AdamOptimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_round_trip_continues_identically(dtype: torch.dtype) -> None:
    params = _params(SHAPES, dtype)
    opt = AdamOptimizer([dict(params=params[:2], weight_decay=0.1), dict(params=params[2:], lr=5e-3)])
    _train(opt, params, range(1, 4))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = AdamOptimizer([dict(params=twins[:2]), dict(params=twins[2:])])
    buf.seek(0)
    twin_opt.load_state_dict(torch.load(buf))
    assert twin_opt.param_groups[0]["weight_decay"] == 0.1 and twin_opt.param_groups[1]["lr"] == 5e-3
    _train(opt, params, range(4, 7))
    _train(twin_opt, twins, range(4, 7))
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t)
        for key in opt.state[p]:
            assert torch.equal(torch.as_tensor(opt.state[p][key]), torch.as_tensor(twin_opt.state[t][key])), key


def test_loading_its_own_live_state_dict_changes_nothing() -> None:
    params = _params(SHAPES, torch.bfloat16)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = AdamOptimizer(params), AdamOptimizer(twins)
    _train(opt, params, range(1, 3))
    _train(twin_opt, twins, range(1, 3))
    opt.load_state_dict(opt.state_dict())  # the saved tensors are the optimizer's own state
    _train(opt, params, range(3, 5))
    _train(twin_opt, twins, range(3, 5))
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t) and torch.equal(opt.state[p]["master"], twin_opt.state[t]["master"])


def test_loads_torch_adamw_state_taking_master_from_parameter() -> None:
    params = _params(SHAPES, torch.bfloat16)
    torch_opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    _train(torch_opt, params, range(1, 3))
    opt = AdamOptimizer(params)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for p in params:
        state, saved = opt.state[p], torch_opt.state[p]
        assert state["step"] == 2 and torch.equal(state["master"], p.detach().float())
        assert torch.equal(state["exp_avg"], saved["exp_avg"].float())
    _train(opt, params, range(3, 4))


def test_load_rejects_other_layout() -> None:
    params = _params(SHAPES, torch.float32)
    opt = AdamOptimizer(params)
    _train(opt, params, range(1, 2))
    with pytest.raises(OptimizerError, match="same param groups"):
        AdamOptimizer(params[:2]).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1e-8),
                                    dict(weight_decay=-0.1), dict(hold_steps=-1)])
def test_invalid_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(OptimizerError, match="invalid Adam hyperparameters"):
        AdamOptimizer(_params([(3,)], torch.float32), **kwargs)


def test_rejects_integer_parameters_and_sparse_gradients() -> None:
    with pytest.raises(OptimizerError, match="floating-point"):
        AdamOptimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
    p = _params([(3,)], torch.float32)[0]
    opt = AdamOptimizer([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(OptimizerError, match="dense gradients"):
        opt.step()
