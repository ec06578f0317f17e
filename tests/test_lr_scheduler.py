"""Warmup schedules: BMTrain's formulas, every param group updated, state_dict round trip."""

from __future__ import annotations

import math

import pytest
import torch

from bmt_wrap.errors import OptimizerError
from bmt_wrap.lr_scheduler import Cosine, Exponential, Linear, Noam, NoDecay, WarmupLRScheduler


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([dict(params=[torch.nn.Parameter(torch.zeros(1))]),
                            dict(params=[torch.nn.Parameter(torch.zeros(1))], lr=5.0)], lr=1.0)


def _lrs(scheduler: WarmupLRScheduler, iters: int) -> list[float]:
    out = [scheduler.current_lr]
    for _ in range(iters):
        scheduler.step()
        assert all(g["lr"] == scheduler.current_lr for g in scheduler.optimizer.param_groups)
        out.append(scheduler.current_lr)
    return out


def test_warmup_is_linear_from_zero() -> None:
    lrs = _lrs(NoDecay(_opt(), start_lr=0.8, warmup_iter=4, end_iter=10), 6)
    assert lrs == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8])


def test_noam_joins_inverse_square_root() -> None:
    lrs = _lrs(Noam(_opt(), start_lr=1.0, warmup_iter=4, end_iter=0), 12)
    assert lrs[:5] == pytest.approx([0.0, 0.125, 0.25, 0.375, 0.5])
    assert lrs[4:] == pytest.approx([1 / math.sqrt(i) for i in range(4, 13)])
    assert Noam(_opt(), start_lr=1.0, warmup_iter=0, end_iter=0).current_lr == 1.0


def test_linear_reaches_zero_at_end_and_stays() -> None:
    lrs = _lrs(Linear(_opt(), start_lr=1.0, warmup_iter=2, end_iter=6), 8)
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])


def test_cosine_halves_at_midpoint_and_stays_at_zero_after_end() -> None:
    lrs = _lrs(Cosine(_opt(), start_lr=2.0, warmup_iter=2, end_iter=10), 14)
    assert lrs[2] == pytest.approx(2.0) and lrs[6] == pytest.approx(1.0) and lrs[10] == pytest.approx(0.0, abs=1e-12)
    assert lrs[4] == pytest.approx(1.0 + math.cos(math.pi / 4))
    assert lrs[11:] == pytest.approx([0.0] * 4, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))


def test_exponential_decays_geometrically() -> None:
    lrs = _lrs(Exponential(_opt(), start_lr=1.0, warmup_iter=1, end_iter=0, num_iter=0, gamma=0.5), 4)
    assert lrs == pytest.approx([0.0, 1.0, 0.5, 0.25, 0.125])


@pytest.mark.parametrize("kind", [NoDecay, Noam, Linear, Cosine, Exponential])
def test_state_dict_round_trip(kind: type[WarmupLRScheduler]) -> None:
    a = kind(_opt(), 1e-3, 3, 20)
    for _ in range(7):
        a.step()
    b = kind(_opt(), 5.0, 1, 2)
    b.load_state_dict(a.state_dict())
    assert b.current_lr == a.current_lr and b.optimizer.param_groups[1]["lr"] == a.current_lr
    for _ in range(5):
        a.step()
        b.step()
        assert b.current_lr == a.current_lr


def test_resume_at_iteration_and_bad_arguments() -> None:
    assert Linear(_opt(), 1.0, 2, 6, num_iter=4).current_lr == pytest.approx(0.5)
    with pytest.raises(OptimizerError, match="warmup_iter"):
        Linear(_opt(), 1.0, -1, 6)
