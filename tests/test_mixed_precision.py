"""MixedPrecision: bf16 shards with fp32 master weights and fp32 gradient reduction track the fp32 run."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.errors import WrapError
from bmt_wrap.optim import AdamOptimizer
from bmt_wrap.wrapper import BMTrainModelWrapper

STEPS = 8


def _train(policy: bmt.MixedPrecision | None) -> dict:
    n, r = bmt.world_size(), bmt.rank()
    torch.manual_seed(0)
    model = BMTrainModelWrapper(ToyGPT(d=32, n_layers=3), mixed_precision=policy)
    opt = AdamOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, dtypes = [], {p.dtype for p in model.parameters()}
    for idx, tgt in lm_batches(STEPS, 8, seed=5):
        loss = model(idx.chunk(n)[r], tgt.chunk(n)[r])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(bmt.sum_loss(loss.detach().float())))
    master = [s["master"] for s in opt.state.values() if "master" in s]
    assert all(m.dtype == torch.float32 for m in master)
    return {"losses": losses, "dtypes": sorted(str(d) for d in dtypes), "masters": len(master),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None} or {"none"})}


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_tracks_fp32_within_bf16_tolerance(world_size: int) -> None:
    fp32 = run_distributed(_train, world_size, None)[0]
    bf16 = run_distributed(_train, world_size, bmt.MixedPrecision(param_dtype=torch.bfloat16))[0]
    assert bf16["dtypes"] == ["torch.bfloat16"] and fp32["dtypes"] == ["torch.float32"]
    assert bf16["masters"] > 0 and fp32["masters"] == 0, "fp32 master weights only for low-precision shards"
    assert bf16["losses"][-1] < bf16["losses"][0], "bf16 training makes progress"
    # bf16 keeps 8 bits of mantissa: relative differences of a few 1e-3 per op, compounding over steps.
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (fp32["losses"], bf16["losses"])


def _io_body() -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    policy = bmt.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = BMTrainModelWrapper(model, mixed_precision=policy)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(str(a[0].dtype)))
    out = model(torch.ones(2, 4))
    return seen + [str(out.dtype)]


def test_inputs_cast_in_outputs_cast_out() -> None:
    assert run_distributed(_io_body, 1)[0] == ["torch.bfloat16", "torch.float32"]


def test_policy_validates_its_dtypes() -> None:
    with pytest.raises(WrapError, match="param_dtype"):
        bmt.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(WrapError, match="float16"):
        bmt.MixedPrecision(param_dtype=torch.float64)
    assert copy.copy(bmt.MixedPrecision()).reduce_dtype == torch.float32
