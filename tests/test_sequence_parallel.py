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


def _bytes_body(name: str, tp: int) -> dict:
    from bmt_wrap.passes.estimate import partial_grad_traffic

    build, batches, loss_fn, tp_plan = _setup(name, steps=1)
    world = bmt.world_size()
    dp, dp_rank = world // tp, bmt.rank() // tp
    model = bmt.BMTrainModelWrapper(models.seeded(build), tp_size=tp, tp_plan=tp_plan, sequence_parallel=True)
    local = tuple(t.chunk(dp)[dp_rank] for t in batches[0])
    run = loss_fn or (lambda m, *b: m(*b))
    run(model, *local).backward()  # the first step fixes the schedule; count the second
    bmt.reset_comm_stats()
    run(model, *local).backward()
    counted = bmt.comm_stats(by_group=True)
    plan = model.plan
    tokens = local[0].numel()
    traffic = plan.tensor_parallel.traffic(tokens, 4, {g.name for g in plan.blocks() if g.checkpoint})
    traffic["all_reduce"] += partial_grad_traffic(plan, dp, dp_rank)
    est = passes.estimate_tp(plan, dp, tokens=tokens, dp_rank=dp_rank)
    return {"counted": {op: v["bytes"] for op, v in counted["tp"].items()}, "plan": traffic,
            "total": sum(v["bytes"] for ops in counted.values() for v in ops.values()), "est": est.comm_total}


@pytest.mark.parametrize("name", ["toy", "llama"])
def test_counted_tp_bytes_equal_the_plans(name: str) -> None:
    # tp2 x dp2: the activations' all-gathers and reduce-scatters along the sequence, the input digest and
    # the sums of the parts' gradients over TP, each byte for byte as the plan accounts them; the whole
    # step's bytes (ZeRO over dp too) equal the plan's estimate
    for r in run_distributed(_bytes_body, 4, name, 2):
        assert r["counted"] == {op: b for op, b in r["plan"].items() if b}, r
        assert r["plan"]["reduce_scatter"] > 0 and r["total"] == r["est"], r


def _norm_bytes(model: torch.nn.Module, run, batch: tuple) -> dict[str, int]:
    """Activation bytes each norm module's forward saves for backward (storages counted once, the norm's own
    parameters left out), over one training step
    of ``model``: a saved-tensor hook pushed on top of the engine's for the norm's forward only, which
    records each tensor and hands it on to the hook below (the block executor's)."""
    from torch._C import _autograd as ag

    seen: dict[str, set[int]] = {}
    held: dict[str, int] = {}

    def enter(name: str, module: torch.nn.Module) -> None:
        below = ag._top_saved_tensors_default_hooks(False)
        pack_below, unpack_below = below if below is not None else (None, None)
        # The norm's weight is saved too: a view of the block's gathered parameters, not an activation.
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen.setdefault(name, set()):
                seen[name].add(ptr)
                held[name] = held.get(name, 0) + t.untyped_storage().nbytes()
            return pack_below(t) if pack_below else t

        ag._push_saved_tensors_default_hooks(pack, unpack_below or (lambda t: t))

    handles = []
    for name, m in model.named_modules():
        if "norm" in type(m).__name__.lower():
            handles.append(m.register_forward_pre_hook(lambda m, a, name=name: enter(name, m)))
            handles.append(m.register_forward_hook(lambda m, a, o: ag._pop_saved_tensors_default_hooks()))
    run(model, *batch).backward()
    for h in handles:
        h.remove()
    return held


def _activation_body(name: str, tp: int) -> dict:
    build, batches, loss_fn, tp_plan = _setup(name, steps=1)
    run = loss_fn or (lambda m, *b: m(*b))
    out = {}
    for sp in (False, True):  # checkpoint=False: blocks keep their activations through the step
        model = bmt.BMTrainModelWrapper(models.seeded(build), tp_size=tp, tp_plan=tp_plan, sequence_parallel=sp,
                                        checkpoint=False)
        out[sp] = _norm_bytes(model, run, batches[0])
    return {"plain": out[False], "sp": out[True]}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["toy", "llama"])
def test_norm_activations_per_rank_are_one_tth(name: str, tp: int) -> None:
    # Measured, not computed: the bytes autograd saves inside each norm's forward, with and without sequence
    # parallelism, on each rank of a tp-T group (dp 1).
    for r in run_distributed(_activation_body, tp, name, tp):
        plain, sp = r["plain"], r["sp"]
        assert plain.keys() == sp.keys() and len(plain) >= 4, r
        in_blocks = [n for n in plain if "layers." in n]
        assert in_blocks and all(sp[n] * tp == plain[n] > 0 for n in in_blocks), r
        final = [n for n in plain if "layers." not in n]  # ln_f / model.norm
        if name == "toy":  # chained to the head: the final norm runs on parts too
            assert all(sp[n] * tp == plain[n] for n in final), r
        else:  # each Llama block gathers its output: the final norm sees the whole sequence
            assert all(sp[n] == plain[n] for n in final), r
