"""Mixed precision, both designs, tracks the fp32 run: ``mixed_precision=`` (FSDP2: fp32 shards that any
optimizer updates at full precision, gathered and computed in bf16, gradients reduced in fp32) and
BMTrain's (the model cast to bf16 before wrapping, ``AdamOptimizer`` keeping fp32 masters)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.cli import main
from bmt_wrap.errors import PlanError, WrapError
from bmt_wrap.optim import AdamOptimizer
from bmt_wrap.passes import build_plan, discover_blocks
from bmt_wrap.wrapper import BMTrainModelWrapper

STEPS = 8
BF16 = bmt.MixedPrecision(param_dtype=torch.bfloat16)


def _train(design: str) -> dict:
    n, r = bmt.world_size(), bmt.rank()
    torch.manual_seed(0)
    model = ToyGPT(d=32, n_layers=3)
    if design == "bmtrain":
        model = BMTrainModelWrapper(model.to(torch.bfloat16))
    else:
        model = BMTrainModelWrapper(model, mixed_precision=BF16 if design == "mixed_precision" else None)
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
    return {"losses": losses, "dtypes": sorted(str(d) for d in dtypes), "masters": len(master)}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("design,dtype,masters", [("mixed_precision", "torch.float32", False),
                                                  ("bmtrain", "torch.bfloat16", True)])
def test_bf16_tracks_fp32_within_bf16_tolerance(world_size: int, design: str, dtype: str, masters: bool) -> None:
    fp32 = run_distributed(_train, world_size, "fp32")[0]
    bf16 = run_distributed(_train, world_size, design)[0]
    assert bf16["dtypes"] == [dtype] and fp32["dtypes"] == ["torch.float32"]
    assert (bf16["masters"] > 0) == masters and fp32["masters"] == 0, \
        "AdamOptimizer keeps fp32 masters only for bf16 shards; mixed_precision='s fp32 shards are the masters"
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


# ---- FSDP2 design: fp32 shards, param_dtype compute and communication ------------------------------------
# LayerNorm weights start at 1.0, where bf16's spacing is 2**-7 above and 2**-8 below: an AdamW step of
# lr=1e-3 is below half of either, so without an fp32 master every step rounds back to exactly 1.0.
LN_LR, LN_STEPS = 1e-3, 5
# With fp32 masters the only difference from fp32 is bf16 compute of the gradients (8 significant bits:
# ~4e-3 relative error per rounding). Adam's update m/sqrt(v) is invariant to the gradient's scale, so
# the drift differs from fp32's only where a gradient's sign is uncertain. Measured per tensor: at most
# 5.4e-3 relative (N=1; 5.0e-3 at N=2); 0.05 is ten times that, far below the 1.0 of vanishing updates.
LN_DRIFT_REL = 0.05


def _ln_drift(policy: bmt.MixedPrecision | None) -> dict:
    n, r = bmt.world_size(), bmt.rank()
    torch.manual_seed(0)
    model = BMTrainModelWrapper(ToyGPT(d=32, n_layers=3), mixed_precision=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LN_LR, weight_decay=0.0)
    grad_dtypes = set()
    for idx, tgt in lm_batches(LN_STEPS, 8, seed=5):
        model(idx.chunk(n)[r], tgt.chunk(n)[r]).backward()
        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    full = model.state_dict()
    return {"drift": {k: v.float() - 1.0 for k, v in full.items() if re.search(r"(^|\.)ln\w*\.weight$", k)},
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(v.dtype) for v in full.values()}),
            "grad_dtypes": sorted(grad_dtypes)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_plain_adamw_moves_layernorm_weights_like_fp32(world_size: int) -> None:
    fp32 = run_distributed(_ln_drift, world_size, None)[0]
    bf16 = run_distributed(_ln_drift, world_size, BF16)[0]
    assert len(fp32["drift"]) == 7, "ln1/ln2 of three layers and ln_f"
    for name, ref in fp32["drift"].items():
        got = bf16["drift"][name]
        # The reference really moves further than bf16 can represent at 1.0 (else the test proves nothing).
        assert ref.abs().mean() > 2 ** -9, (name, ref.abs().mean())
        rel = float((got - ref).norm() / ref.norm())
        assert rel <= LN_DRIFT_REL, (name, rel, float(got.abs().mean()), float(ref.abs().mean()))


@pytest.mark.parametrize("world_size", [1, 2])
def test_parameters_and_gradients_stay_fp32(world_size: int) -> None:
    r = run_distributed(_ln_drift, world_size, BF16)[0]
    assert r["param_dtypes"] == ["torch.float32"], "model.parameters() are the fp32 shards"
    assert r["grad_dtypes"] == ["torch.float32"], "gradients land as fp32 .grad on the fp32 shards"
    assert r["state_dtypes"] == ["torch.float32"], "state_dict holds the fp32 values, not a bf16 copy"


def _comm_per_step(policy: bmt.MixedPrecision | None) -> dict:
    n, r = bmt.world_size(), bmt.rank()
    torch.manual_seed(0)
    model = BMTrainModelWrapper(ToyGPT(d=32, n_layers=3), mixed_precision=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, tgt = lm_batches(1, 8, seed=5)[0]
    bmt.reset_comm_stats()
    model(idx.chunk(n)[r], tgt.chunk(n)[r]).backward()
    opt.step()
    stats = bmt.comm_stats()
    est = model.plan.estimates[str(n)]
    return {"stats": stats, "est_ag": est.comm_all_gather, "est_rs": est.comm_reduce_scatter}


def test_all_gather_communicates_param_dtype() -> None:
    fp32 = run_distributed(_comm_per_step, 2, None)[0]
    bf16 = run_distributed(_comm_per_step, 2, BF16)[0]
    ag32, ag16 = fp32["stats"]["all_gather"], bf16["stats"]["all_gather"]
    assert ag16["calls"] == ag32["calls"] and ag16["bytes"] * 2 == ag32["bytes"], (ag16, ag32)
    # reduce_dtype defaults to fp32: gradients are averaged at full precision.
    assert bf16["stats"]["reduce_scatter"] == fp32["stats"]["reduce_scatter"]
    for r in (fp32, bf16):
        assert r["stats"]["all_gather"]["bytes"] == r["est_ag"]
        assert r["stats"]["reduce_scatter"]["bytes"] == r["est_rs"]


# ---- plan and CLI: memory per rank for both designs -----------------------------------------------------
def _estimates(n: int) -> tuple[bmt.WrapPlan, bmt.WrapPlan]:
    model = ToyGPT(d=32, n_layers=3)
    d = discover_blocks(model)
    return (build_plan(model, d, world_size=n, mixed_precision=BF16),
            build_plan(model, d, world_size=n, dtype=torch.bfloat16))


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_plan_counts_fp32_shards_and_bf16_gathers(world_size: int) -> None:
    n = world_size
    fsdp, bmtrain = _estimates(n)
    assert {(b.dtype, b.gather_dtype, b.grad_dtype) for g in fsdp.groups for b in g.buffers} == \
        {("float32", "bfloat16", "float32")}
    assert {(b.dtype, b.gather_dtype, b.grad_dtype) for g in bmtrain.groups for b in g.buffers} == \
        {("bfloat16", "bfloat16", "bfloat16")}
    f, b = fsdp.estimates[str(n)], bmtrain.estimates[str(n)]
    shard32 = sum(x.shard_numel(n) for g in fsdp.groups for x in g.buffers)
    shard16 = sum(x.shard_numel(n) for g in bmtrain.groups for x in g.buffers)
    # FSDP2: fp32 shard, fp32 gradient, fp32 moments (the shard is the master): (4 + 4 + 8) bytes.
    assert (f.params, f.grads, f.optimizer) == (4 * shard32, 4 * shard32, 8 * shard32)
    # BMTrain: bf16 shard and gradient; the optimizer holds fp32 master + moments: (2 + 2 + 12) bytes.
    assert (b.params, b.grads, b.optimizer) == (2 * shard16, 2 * shard16, 12 * shard16)
    # Gathered parameters are bf16 in both; the casting gather also holds a bf16 copy of the shard it sends.
    root, block = fsdp.group("root"), fsdp.blocks()[0]
    def held(g: bmt.plan.ShardGroupSpec) -> int:
        return sum(2 * (x.padded_numel(n) + x.shard_numel(n)) for x in g.buffers)
    assert f.gathered == held(root) + 3 * held(block)  # prefetch depth 1: the pool holds 3 (depth + 2)
    assert f.grads_in_flight == 4 * block.buffers[0].padded_numel(n), "reduce_dtype fp32"
    assert b.grads_in_flight == 2 * bmtrain.blocks()[0].buffers[0].padded_numel(n)
    padded32 = sum(x.padded_numel(n) for g in fsdp.groups for x in g.buffers)
    assert f.comm_reduce_scatter == 4 * padded32 * (n - 1) // n
    assert f.zero3_bound == (2 + 2 + 4) * padded32 * (n - 1) // n


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return re.findall(r"\d+(?:\.\d+)? \w+", line)


def test_cli_plan_reports_both_designs(capsys: pytest.CaptureFixture[str]) -> None:
    model = "tests/models.py:llama"
    assert main(["plan", model, "--world-size", "1", "8", "--mixed-precision", "bf16"]) == 0
    mixed = capsys.readouterr().out
    assert main(["plan", model, "--world-size", "1", "8", "--dtype", "bf16"]) == 0
    bmtrain = capsys.readouterr().out
    assert "(float32 gathered as bfloat16)" in mixed.splitlines()[0]
    assert "(bfloat16)" in bmtrain.splitlines()[0]

    def kib(text: str) -> float:
        value, unit = text.split()
        return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]

    for column in (0, 1):
        m = {k: kib(_row(mixed, k)[column]) for k in ("parameters", "optimizer", "= model states", "gathered")}
        b = {k: kib(_row(bmtrain, k)[column]) for k in m}
        assert m["parameters"] == pytest.approx(2 * b["parameters"], rel=0.05)  # fp32 vs bf16 shards
        assert m["optimizer"] == pytest.approx(2 / 3 * b["optimizer"], rel=0.05)  # moments vs master + moments
        assert m["= model states"] == pytest.approx(b["= model states"], rel=0.05)  # 16 bytes per parameter
    # bf16 gathers in both; mixed precision also holds the bf16 copy of the shard it sends.
    n8 = (kib(_row(mixed, "gathered")[1]), kib(_row(bmtrain, "gathered")[1]))
    assert n8[0] == pytest.approx(n8[1] * (1 + 1 / 8), rel=0.05)


def _mismatched_plan() -> str:
    model = ToyGPT(d=32, n_layers=3)
    plan = build_plan(model, discover_blocks(model), world_size=bmt.world_size())
    try:
        BMTrainModelWrapper(model, plan=plan, mixed_precision=BF16)
    except PlanError as exc:
        return str(exc)
    return "no error"


def test_plan_made_without_the_policy_is_refused() -> None:
    assert "Pass the mixed_precision= the plan was made with" in run_distributed(_mismatched_plan, 1)[0]
