"""FusedCrossEntropy on CPU against torch.nn.functional.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernel_checks.reference import assert_within_one_rounding

from bmt_wrap.errors import BMTError
from bmt_wrap.loss import FusedCrossEntropy, torch_rows


def _case(n: int, c: int, dtype: torch.dtype, seed: int, ignored: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, c, generator=g) * 4).to(dtype)
    target = torch.randint(0, c, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = -100
    return logits, target


def _check(logits: torch.Tensor, target: torch.Tensor, reduction: str, smoothing: float) -> None:
    x = logits.clone().requires_grad_()
    loss = FusedCrossEntropy(reduction=reduction, label_smoothing=smoothing)(x, target)
    assert loss.dtype == torch.float32
    ref_x = logits.double().requires_grad_()
    ref = F.cross_entropy(ref_x, target, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    weight = torch.randn(loss.shape, dtype=torch.float64)
    (loss * weight.float()).sum().backward()
    (ref * weight).sum().backward()
    assert x.grad.dtype == logits.dtype
    if logits.dtype == torch.float32:
        # softmax - target cancels near p = 1: an fp32 rounding of 1 times the incoming gradient
        torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-5, atol=3e-7 * float(weight.abs().max()))
    else:  # the exact gradient, rounded once to the logits' dtype
        assert_within_one_rounding(x.grad, ref_x.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_matches_torch(dtype: torch.dtype, reduction: str, smoothing: float) -> None:
    _check(*_case(33, 50, dtype, seed=1), reduction, smoothing)


@given(n=st.integers(1, 40), c=st.integers(1, 70), seed=st.integers(0, 100), smoothing=st.floats(0.0, 1.0),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_property_matches_torch(n: int, c: int, seed: int, smoothing: float, reduction: str) -> None:
    logits, target = _case(n, c, torch.float32, seed)
    target[0] = 0  # keep one row so the mean is defined
    _check(logits, target, reduction, smoothing)


def test_slices_of_rows_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, target = _case(20, 30, torch.bfloat16, seed=2)
    whole = FusedCrossEntropy(label_smoothing=0.1, reduction="none")(logits, target)
    monkeypatch.setattr(torch_rows, "_SLICE", 64)  # two rows per slice
    _check(logits, target, "none", 0.1)
    torch.testing.assert_close(FusedCrossEntropy(label_smoothing=0.1, reduction="none")(logits, target), whole)


def test_saves_no_fp32_copy_of_the_logits() -> None:
    logits = torch.randn(64, 1000).bfloat16().requires_grad_()
    loss = FusedCrossEntropy()(logits, torch.randint(0, 1000, (64,)))
    node = loss.grad_fn
    while type(node).__name__ != "_RowCrossEntropyBackward":
        node = node.next_functions[0][0]
    saved = node.saved_tensors
    assert saved[0] is logits or saved[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved[1:]) == 64 * (8 + 4), "targets + one float per row"


def test_all_ignored_mean_is_nan_like_torch() -> None:
    logits, target = _case(4, 5, torch.float32, seed=3)
    target[:] = -100
    assert torch.isnan(FusedCrossEntropy()(logits, target)) and torch.isnan(F.cross_entropy(logits, target))


def test_bad_inputs() -> None:
    logits, target = _case(4, 5, torch.float32, seed=3, ignored=0.0)
    with pytest.raises(BMTError, match="outside"):
        FusedCrossEntropy()(logits, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(BMTError, match=r"\(N, C\)"):
        FusedCrossEntropy()(logits[None], target[None])
    with pytest.raises(BMTError, match="reduction"):
        FusedCrossEntropy(reduction="avg")
    with pytest.raises(BMTError, match="label_smoothing"):
        FusedCrossEntropy(label_smoothing=1.5)
