"""``BMTrainModelWrapper(model, tp_size=T, sequence_parallel=True)`` on gloo ranks: parity with plain PyTorch
at tp2 (2 ranks), tp2 x dp2 and tp4 (4 ranks) for the toy GPT and a tiny transformers Llama (losses, whole
gradients, parameters; the Contracts' tolerances), dropout on at world size T bit-equal to one process,
the norms' saved input activations measured at 1/T of plain TP's, and bytes counted equal to the plan's."""

from __future__ import annotations

import copy

import models
import pytest
import torch
from dist_harness import raised, run_distributed
from parity import lm_batches, train_side_by_side
from test_tp_plan import TOY_PLAN
from test_tp_wrap import llama_mha

import bmt_wrap as bmt
from bmt_wrap import passes


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _setup(name: str, steps: int = 3, batch: int = 4):
    """(build, batches, loss_fn, tp_plan) for the toy GPT (a user plan) or the Llama (its own plan)."""
    if name == "toy":
        return models.ToyGPT, lm_batches(steps, batch), None, TOY_PLAN
    if name == "toy_dropout":  # residual dropout after each row Linear, on sequence parts
        return (lambda: models.ToyGPT(dropout=0.1)), lm_batches(steps, batch), None, TOY_PLAN
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, models.VOCAB, (batch, 8), generator=g),) for _ in range(steps)]
    return llama_mha, batches, _hf_loss, None


def _parity_body(name: str, tp: int, optimizer: str, checkpoint: bool = True) -> dict:
    build, batches, loss_fn, tp_plan = _setup(name)
    rank, world, wrapped = bmt.rank(), bmt.world_size(), []

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(bmt.BMTrainModelWrapper(m, tp_size=tp, tp_plan=tp_plan, sequence_parallel=True,
                                               checkpoint=checkpoint))
        return wrapped[0]

    # train_side_by_side asserts losses, whole gradients and parameters at every step, on every rank
    result = train_side_by_side(build, wrap, batches, optimizer=optimizer, loss_fn=loss_fn,
                                data_parallel=(rank // tp, world // tp),
                                reseed=0 if name == "toy_dropout" else None)
    sp = wrapped[0].plan.tensor_parallel.sequence
    return {"losses": result["losses"], "enabled": sp.enabled, "kinds": sorted({p.kind for p in sp.points}),
            "plan": str(wrapped[0].plan), "dropouts": sp.dropouts}


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("name", ["toy", "llama"])
def test_sequence_parallel_matches_plain_pytorch_sgd(name: str, world: int, tp: int) -> None:
    results = run_distributed(_parity_body, world, name, tp, "sgd")
    assert all(r["losses"] == results[0]["losses"] and len(r["losses"]) == 3 for r in results)
    assert all(r["enabled"] and {"unit", "row", "column"} <= set(r["kinds"]) for r in results), results[0]
    if name == "toy":  # the root traces: blocks chained, the head gathers the final norm's output
        assert "sp enter layers.0" in results[0]["plan"] and "sp head head" in results[0]["plan"]
        assert "sp leave" not in results[0]["plan"]
    else:  # LlamaForCausalLM's root does not trace: each block cuts and gathers, with the reason shown
        assert "sp leave model.layers.1" in results[0]["plan"] and "not chained" in results[0]["plan"]


@pytest.mark.parametrize("name", ["toy", "llama"])
def test_sequence_parallel_tp2_dp2_matches_plain_pytorch_adamw(name: str) -> None:
    results = run_distributed(_parity_body, 4, name, 2, "adamw")
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.parametrize("tp, checkpoint", [(2, True), (4, False)])
def test_dropout_on_sequence_parts_matches_one_process(tp: int, checkpoint: bool) -> None:
    # World size T, dp 1: each rank draws the whole sequence's mask and keeps its part, so its dropout is
    # one process's on that part (train_side_by_side reseeds both sides alike and asserts every step).
    results = run_distributed(_parity_body, tp, "toy_dropout", tp, "sgd", checkpoint)
    assert all(r["enabled"] and r["dropouts"] == [f"layers.{i}.drop" for i in range(4)] for r in results)
    assert all(r["losses"] == results[0]["losses"] for r in results)
