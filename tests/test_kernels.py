"""The CUDA kernels' arithmetic, run on the CPU through the g++ host harness, against torch.

The harness includes the same headers CuPy compiles into the GPU kernels, so these tests check the
conversions, the Adam update and the cross-entropy row math on every CI run, GPU or not. The last
tests launch the real kernels and are skipped without CUDA and CuPy.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import harness
from kernel_checks.reference import ReferenceAdamW, assert_within_one_rounding

from bmt_wrap.kernels import cupy_usable, source_define
from bmt_wrap.optim.adam_math import AdamHyper, adam_scalars

LOW = [torch.bfloat16, torch.float16]
CE_THREADS = source_define("cross_entropy.cu", "BMT_CE_THREADS")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def _interesting_floats() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    scales = torch.pow(2.0, torch.arange(-30, 20, dtype=torch.float32))
    scaled = (torch.randn(4096, generator=g)[:, None] * scales[None, :]).reshape(-1)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 65536.0,
                             2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -26, 2.0 ** -14, 3.0 * 2.0 ** -25,
                             1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                             3.3895313892515355e38, 3.4e38, 1e-40, -1e-45])
    return torch.cat([random_bits.view(torch.float32), scaled, specials, -specials])


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_round_to_low_precision_matches_torch(dtype: torch.dtype) -> None:
    x = _interesting_floats()
    _same_bits(harness.from_float(x, dtype), x.to(dtype))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_widen_every_low_precision_value(dtype: torch.dtype) -> None:
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    out = harness.to_float(every)
    nan = every.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), every[~nan].float().view(torch.int32))


def test_is_finite_matches_torch() -> None:
    x = _interesting_floats()
    assert torch.equal(harness.is_finite(x), torch.isfinite(x))


def _adam_steps(dtype: torch.dtype, scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    n = 1000
    hyper = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    init = torch.randn(n, generator=g).to(dtype)
    param = init.clone()
    master = init.float() if dtype != torch.float32 else None
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    ref = ReferenceAdamW([init], [([0], hyper)])
    for step in range(1, 21):
        grad = (torch.randn(n, generator=g) * 0.1 * (1 + step % 3)).to(dtype)
        scalars = adam_scalars(AdamHyper(hyper["lr"], *hyper["betas"], hyper["eps"], hyper["weight_decay"], step), scale)
        harness.adam(param, (grad.float() * scale).to(dtype), master, exp_avg, exp_avg_sq, scalars)
        ref.step([grad])
        state = ref.opt.state[ref.params[0]]
        torch.testing.assert_close(exp_avg.double(), state["exp_avg"], rtol=1e-5, atol=1e-7)
        if master is None:
            torch.testing.assert_close(param.double(), ref.params[0].detach(), rtol=1e-5, atol=1e-7)
        else:
            torch.testing.assert_close(master.double(), ref.params[0].detach(), rtol=1e-5, atol=1e-7)
            _same_bits(param, master.to(dtype))
            assert_within_one_rounding(param, ref.params[0].detach())


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_adam_element_matches_adamw(dtype: torch.dtype) -> None:
    _adam_steps(dtype, scale=1.0)


def test_adam_element_unscales_gradients() -> None:
    _adam_steps(torch.float16, scale=1024.0)


def _ce_inputs(dtype: torch.dtype, n_rows: int, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n_rows * 1000 + n_classes)
    logits = (torch.randn(n_rows, n_classes, generator=g) * 3).to(dtype)
    target = torch.randint(0, n_classes, (n_rows,), generator=g)
    target[::5] = -100
    logits[1, : n_classes // 2] = -math.inf  # masked logits (the target column stays finite)
    target[1] = n_classes - 1
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("n_classes", [3, 300, 1000])
def test_cross_entropy_rows_match_torch(dtype: torch.dtype, smoothing: float, n_classes: int) -> None:
    logits, target = _ce_inputs(dtype, 17, n_classes)
    loss, lse = harness.ce_forward(logits, target, -100, smoothing, CE_THREADS)
    x = logits.double().requires_grad_()
    ref = F.cross_entropy(x, target, ignore_index=-100, reduction="none", label_smoothing=smoothing)
    finite = torch.isfinite(ref)  # torch gives inf/nan for smoothing over -inf logits; so do we
    torch.testing.assert_close(loss.double()[finite], ref.detach()[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isfinite(loss), finite)
    valid = target != -100
    torch.testing.assert_close(lse.double()[valid], torch.logsumexp(x.detach(), 1)[valid], rtol=1e-6, atol=1e-6)

    weights = torch.randn(17, dtype=torch.float64) * finite
    (ref[finite] * weights[finite]).sum().backward()
    grad = harness.ce_backward(logits, target, lse, (weights * valid).float(), smoothing)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double()[finite], x.grad[finite].to(dtype).double(),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_cross_entropy_bad_target_gives_nan_not_a_read_out_of_bounds() -> None:
    logits, target = _ce_inputs(torch.float32, 4, 10)
    target[2] = 10
    loss, _ = harness.ce_forward(logits, target, -100, 0.0, CE_THREADS)
    assert math.isnan(loss[2].item()) and torch.isfinite(loss[[0, 3]]).all()


# ---- the real kernels (CUDA + CuPy) ----------------------------------------------------------------------
def _cuda_with_cupy() -> bool:
    return torch.cuda.is_available() and cupy_usable(torch.empty(0, device="cuda"))


gpu = pytest.mark.skipif(not _cuda_with_cupy(), reason="needs a CUDA device and CuPy (pip install 'bmt-wrap[gpu]')")

_BLOCK = 256  # the kernels' threads per block


def _past_one_grid(per_item: int = 1) -> int:
    """Items (of ``per_item`` elements) for more elements than the largest grid covers in one pass, so
    every grid-stride loop runs at least three iterations: a wrong stride changes the result."""
    from bmt_wrap.kernels import grid_for

    device = torch.device("cuda")
    largest = grid_for(2**40, _BLOCK, device) * _BLOCK
    items = -(-3 * largest // per_item) + 7
    assert items * per_item > 3 * grid_for(items * per_item, _BLOCK, device) * _BLOCK
    return items


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_cupy_adam_kernel_matches_cpu_optimizer(dtype: torch.dtype) -> None:
    from bmt_wrap.optim import AdamOptimizer

    torch.manual_seed(0)
    n = _past_one_grid()
    cut = n // 2 // 64 * 64
    # Two parameters of one flat buffer with a zeroed alignment gap between them, as the engine lays
    # them out: the fusion planner covers both with one run only across a short, zero gap.
    slices = ((0, cut - 16), (cut, n))
    flat = torch.randn(n).to(dtype)
    flat[cut - 16:cut] = 0
    # One flat buffer per device (``flat.to(dev)`` once, not per slice): the two views share its storage.
    flats = {dev: flat.to(dev) for dev in ("cpu", "cuda")}
    params = {dev: [torch.nn.Parameter(f[a:b]) for a, b in slices] for dev, f in flats.items()}
    opts = {dev: AdamOptimizer(ps, lr=1e-2, weight_decay=0.1) for dev, ps in params.items()}
    for _ in range(5):
        grads = torch.randn(n).to(dtype)
        for dev, ps in params.items():
            scaled = grads.to(dev) * 8  # gradients also views of one buffer, as the engine lays them out
            scaled[cut - 16:cut] = 0
            for p, (a, b) in zip(ps, slices, strict=True):
                p.grad = scaled[a:b]
            opts[dev].step(scale=8.0)
    assert opts["cuda"].last_step_runs == 1
    for pc, pg in zip(params["cpu"], params["cuda"], strict=True):
        torch.testing.assert_close(pg.detach().cpu().double(), pc.detach().double(),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_cupy_cross_entropy_matches_cpu(dtype: torch.dtype) -> None:
    from bmt_wrap.loss import FusedCrossEntropy

    logits, target = _ce_inputs(dtype, _past_one_grid(per_item=5000), 5000)
    logits[1] = 0.5
    outs = {}
    for dev in ("cpu", "cuda"):
        x = logits.to(dev, copy=True).requires_grad_()  # a leaf per device: .to("cpu") alone would alias
        loss = FusedCrossEntropy(label_smoothing=0.1)(x, target.to(dev))
        loss.backward()
        outs[dev] = (loss.detach().cpu(), x.grad.cpu())
    torch.testing.assert_close(outs["cuda"][0], outs["cpu"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["cuda"][1].double(), outs["cpu"][1].double(), rtol=1e-2, atol=1e-6)
