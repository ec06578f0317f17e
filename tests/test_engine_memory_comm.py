"""Memory per rank and bytes communicated per step, against docs/design.md's formulas.

Memory is counted independently of the engine's own accounting: every tensor the garbage collector can
see plus every tensor autograd saved for backward, deduplicated by storage, at the executor's peak (the
recompute of a middle block in backward).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.dtypes import itemsize
from bmt_wrap.runtime.grad_reduce import MAX_IN_FLIGHT

D, LAYERS = 64, 4
BLOCKS = [f"layers.{i}" for i in range(LAYERS)]


def _live_bytes(saved: list[weakref.ref], root_storage: int | None = None) -> tuple[int, int]:
    """(every live storage's bytes, bytes of activations: storages only autograd holds, minus the root)."""
    gc.collect()
    visible: dict[int, int] = {}
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                s = t.untyped_storage()
                visible[s.data_ptr()] = s.nbytes()
            except RuntimeError:  # a fake tensor an earlier test's torch.export left for gc: no memory
                continue
    hidden: dict[int, int] = {}
    for t in (r() for r in saved):
        if t is not None:
            s = t.untyped_storage()
            if s.data_ptr() not in visible:
                hidden[s.data_ptr()] = s.nbytes()
    activations = sum(v for k, v in hidden.items() if k != root_storage)
    return sum(visible.values()) + sum(hidden.values()), activations


def _memory_body(depth: int, zero_level: int) -> dict:
    n = bmt.world_size()
    saved: list[weakref.ref] = []
    baseline, _ = _live_bytes(saved)
    torch.manual_seed(0)
    model = ToyGPT(vocab=64, d=D, n_layers=LAYERS, tied=True)
    plan = manual_plan(model, BLOCKS, prefetch_depth=depth, zero_level=zero_level)
    model = apply_plan(model, plan)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    peak: dict[str, int] = {}
    calls = [0]
    root = {}

    def probe(module, inputs, output):  # fires in forward and again in the recompute during backward
        calls[0] += 1
        if calls[0] == 4:  # step 1: forward (1), recompute (2); step 2: forward (3), recompute (4)
            total, peak["activations"] = _live_bytes(saved, root["storage"])
            peak["bytes"] = total - baseline

    def see_root(module, inputs):  # the gathered root buffer, as the model's own code sees it
        root["storage"] = module.weight.untyped_storage().data_ptr()

    model.layers[1].fc.register_forward_hook(probe)
    model.wte.register_forward_pre_hook(see_root)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    for idx, tgt in lm_batches(2, n, seq=2):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx.chunk(n)[bmt.rank()], tgt.chunk(n)[bmt.rank()])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        saved.clear()

    def padded(g) -> int:
        return sum(b.shard_numel(n) * itemsize(b.dtype) for b in g.buffers)

    state = sum(padded(g) for g in plan.groups)  # bytes of one copy of the sharded model state
    blocks = [g for g in plan.groups if not g.is_root]
    root = plan.groups[0]
    largest = max(g.padded_bytes(n) for g in blocks)
    gathered = root.padded_bytes(n) + (
        sum(g.padded_bytes(n) for g in blocks) if zero_level == 2 else (depth + 1) * largest)
    # Gradient shards live from a block's reduce-scatter until zero_grad(set_to_none=True): at the probe
    # (backward of layers.1) only layers.2 and layers.3 have theirs.
    grads = sum(padded(g) for g in blocks[2:])
    # gloo's ring reduce-scatter (N > 2) holds one shard of scratch while a reduce-scatter is in flight.
    ring = largest // n if n > 2 else 0
    formula = 3 * state + grads + gathered + MAX_IN_FLIGHT * (largest + ring)  # params, Adam moments, grads
    return {"measured": peak["bytes"], "formula": formula + peak["activations"],
            "activations": peak["activations"]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_peak_memory_matches_the_formula(world_size: int, depth: int) -> None:
    for r in run_distributed(_memory_body, world_size, depth, 3):
        assert abs(r["measured"] - r["formula"]) <= 0.05 * r["formula"], r


@pytest.mark.parametrize("world_size", [2, 4])
def test_peak_memory_with_zero2_keeps_every_block(world_size: int) -> None:
    for r in run_distributed(_memory_body, world_size, 1, 2):
        assert abs(r["measured"] - r["formula"]) <= 0.05 * r["formula"], r


def _comm_body(zero_level: int) -> dict:
    n = bmt.world_size()
    torch.manual_seed(0)
    model = ToyGPT(vocab=64, d=D, n_layers=LAYERS)
    plan = manual_plan(model, BLOCKS, zero_level=zero_level)
    model = apply_plan(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for idx, tgt in lm_batches(3, n):
        bmt.reset_comm_stats()
        model(idx.chunk(n)[bmt.rank()], tgt.chunk(n)[bmt.rank()]).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(bmt.comm_stats())
    psi = sum(g.param_bytes() for g in plan.groups)
    frac = (n - 1) / n
    padded = {g.name: g.padded_bytes(n) * frac for g in plan.groups}
    gathers = 1 if zero_level == 2 else 2
    return {"steps": per_step, "psi": psi, "bound": 3 * psi * frac,
            "expected_ag": round(padded["root"] + gathers * sum(v for k, v in padded.items() if k != "root")),
            "expected_rs": round(sum(padded.values()))}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("zero_level", [2, 3])
def test_bytes_per_step_match_zero3(world_size: int, zero_level: int) -> None:
    r = run_distributed(_comm_body, world_size, zero_level)[0]
    for stats in r["steps"]:
        assert stats["all_gather"]["bytes"] == r["expected_ag"]
        assert stats["reduce_scatter"]["bytes"] == r["expected_rs"]
        # one all-reduce per backward: which parameters got a gradient (a few bytes)
        assert stats["all_reduce"]["calls"] == 1
        total = sum(v["bytes"] for v in stats.values())
        assert total <= 1.02 * r["bound"], (total, r["bound"])
