"""Two wrapped models in one process (teacher and student, an EMA copy): each keeps its own schedule.

Each model trains alternately with the other and must match plain PyTorch, and every step of it must
issue exactly the collectives (op, group, size, order) it issues when it is the only wrapped model:
one model's prefetch never gathers the other's blocks, nor loses its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_distributed
from parity import compare_grads, compare_params, lm_batches
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap import distributed
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.runtime.process_engine import reset_engine

STEPS = 3
SIZES = {"a": {"d": 16, "n_layers": 3}, "b": {"d": 24, "n_layers": 2}}


def _build(which: str) -> ToyGPT:
    torch.manual_seed({"a": 0, "b": 1}[which])
    return ToyGPT(**SIZES[which])


def _wrap(model: ToyGPT) -> ToyGPT:
    return apply_plan(model, manual_plan(model, [f"layers.{i}" for i in range(len(model.layers))]))


def _train(names: list[str]) -> dict[str, list]:
    """Wrap the models ``names`` in a fresh engine, train them alternately beside plain copies; returns
    each model's per-step collective traces after checking its parity with plain PyTorch."""
    reset_engine()
    rank, n = bmt.rank(), bmt.world_size()
    refs = {k: _build(k) for k in names}
    models = {k: _wrap(copy.deepcopy(refs[k])) for k in names}
    opts = {k: torch.optim.SGD(models[k].parameters(), lr=0.1) for k in names}
    ref_opts = {k: torch.optim.SGD(refs[k].parameters(), lr=0.1) for k in names}
    batches = {k: lm_batches(STEPS, 8, seed=i + 1) for i, k in enumerate(names)}
    traces: dict[str, list] = {k: [] for k in names}
    for step in range(STEPS):
        for k in names:
            idx, tgt = batches[k][step]
            ref_loss = refs[k](idx, tgt)
            ref_loss.backward()
            with distributed.comm().trace() as ops:
                loss = models[k](idx.chunk(n)[rank], tgt.chunk(n)[rank])
                loss.backward()
                bmt.synchronize()
            traces[k].append(ops)
            torch.testing.assert_close(float(bmt.sum_loss(loss)), float(ref_loss), rtol=1e-5, atol=0,
                                       msg=lambda m, k=k, step=step: f"model {k} step {step} loss: {m}")
            compare_grads(refs[k], models[k], f"model {k} step {step}")
            for o in (opts[k], ref_opts[k]):
                o.step()
                o.zero_grad()
    for k in names:
        compare_params(refs[k], models[k], "sgd", f"model {k} after training")
    return traces


def _body() -> dict[str, object]:
    alone = {**_train(["a"]), **_train(["b"])}
    together = _train(["a", "b"])
    return {"alone": alone, "together": together}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_two_wrapped_models_keep_their_own_schedules(world_size: int) -> None:
    for rank, result in enumerate(run_distributed(_body, world_size)):
        for k in SIZES:
            for step, (mine, solo) in enumerate(zip(result["together"][k], result["alone"][k], strict=True)):
                assert mine == solo, (f"rank {rank}, model {k}, step {step}: with the other model wrapped "
                                      f"too it issued {mine}, alone {solo}")
        if world_size > 1:
            assert any(op == "all_gather" for op, _, _ in result["alone"]["a"][1]), "the trace sees gathers"
