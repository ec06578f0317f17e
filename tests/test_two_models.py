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


def _what_a_dropped_model_leaves(family: str = "toy") -> dict[str, int]:
    """How many of a trained, then dropped, model's parameters and gradients are still alive, and how many
    bytes of the storages they used. ``family``: the toy GPT by hand-written plan, or a transformers Llama
    through the one-liner (its untied head in a root buffer of its own, with a hook of its own), alone or at
    ``tp_size=2`` (sequence parallelism's hooks)."""
    import gc
    import weakref

    import models

    reset_engine()
    rank, n = bmt.rank(), bmt.world_size()
    if family == "toy":
        idx, tgt = lm_batches(1, 8, seed=1)[0]
        model = _wrap(_build("a"))
        model(idx.chunk(n)[rank], tgt.chunk(n)[rank]).backward()  # .grad set and left there, as after a step
    else:
        model = bmt.BMTrainModelWrapper(models.llama(), **({"tp_size": 2} if family == "llama_tp2" else {}))
        seed = 0 if family == "llama_tp2" else rank  # TP peers take the same batch
        ids = torch.randint(0, models.VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    refs = [weakref.ref(t) for t in tensors]
    storages = {t._local.untyped_storage().data_ptr() for t in tensors}  # the flat shards and gradients
    del model, tensors
    gc.collect()
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
            if type(t) is torch.Tensor and t.device.type == "cpu"}
    return {"tracked": len(refs), "alive": sum(r() is not None for r in refs),
            "storage_bytes": sum(live.get(ptr, 0) for ptr in storages)}


@pytest.mark.parametrize(("family", "world_size"),
                         [("toy", 1), ("toy", 2), ("llama", 1), ("llama", 2), ("llama_tp2", 2)])
def test_a_dropped_model_frees_its_shards(family: str, world_size: int) -> None:
    """A sweep or an evaluation copy wraps models one after another: a model that is gone must take its
    shards and gradients with it. Two references once kept them for the process's life: the engine's map
    from group to runtime (a value holding its own key), and each ``.grad``'s layout (torch holds ``.grad``
    in C++, so the cycle through it was invisible to the garbage collector); and once, the process-wide table of
    hooks marked for dynamo, which kept each model's closures (its head's regather hook, sequence parallelism's)."""
    for out in run_distributed(_what_a_dropped_model_leaves, world_size, family):
        assert out["tracked"] > 0
        assert out["alive"] == 0 and out["storage_bytes"] == 0, out
