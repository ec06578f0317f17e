"""The root's gradient held no longer than its last use needs (#35 item 3): an untied vocabulary head, laid out
in a root buffer of its own, is reduce-scattered as soon as the head's backward ends, before any block's; the
model still trains as plain PyTorch does, fused or not, and a tied head (whose gradient comes last) is
untouched."""

from __future__ import annotations

import models
import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches, train_side_by_side

import bmt_wrap as bmt
from bmt_wrap.loss import linear_cross_entropy as lce
from bmt_wrap.plan import ROOT
from bmt_wrap.wrapper import BMTrainModelWrapper


def qwen2_tied() -> torch.nn.Module:
    """Qwen2 with its embedding and head tied, as its small checkpoints are."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return models.seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**models._hf_small(), tie_word_embeddings=True)))


FACTORIES = {"llama": models.llama, "qwen2_tied": qwen2_tied, "gpt2": models.gpt2}


def _loss(model: torch.nn.Module, ids: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # as users call it: labels given, use_cache at its default


def _body(name: str, fused: bool) -> dict:
    build = FACTORIES[name]
    holder: dict = {}

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        holder["model"] = BMTrainModelWrapper(m, fused_loss=fused)
        return holder["model"]

    batches = lm_batches(3, 4, seq=8, vocab=models.VOCAB)
    out = train_side_by_side(build, wrap, batches, loss_fn=_loss)
    model = holder["model"]
    n, rank = bmt.world_size(), bmt.rank()
    ids = batches[0][0].chunk(n)[rank]
    with bmt.get_state().comm.trace() as ops:
        _loss(model, ids).backward()
    model.zero_grad()
    root = next(g for g in model.plan.groups if g.is_root)
    return {"order": [(label, numel) for op, label, numel in ops if op == "reduce_scatter"],
            "root_buffers": [[s.fqn for s in b.slots] for b in root.buffers],
            "loss_diff": out["loss_diff"]}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_an_untied_heads_gradient_is_reduced_before_the_blocks(world: int, fused: bool) -> None:
    for got in run_distributed(_body, world, "llama", fused):
        assert ["lm_head.weight"] in got["root_buffers"], got["root_buffers"]
        order = [label for label, _ in got["order"]]
        assert order[0] == ROOT, f"the head's reduce-scatter comes after a block's: {got['order']}"
        assert any(label != ROOT for label in order[1:]), got["order"]
        assert order.count(ROOT) == len(got["root_buffers"]), got["order"]  # each root buffer once, no zeros


@pytest.mark.parametrize("name", ["gpt2", "qwen2_tied"])
def test_a_tied_head_stays_in_the_roots_last_reduce(name: str) -> None:
    for got in run_distributed(_body, 2, name, False):
        order = [label for label, _ in got["order"]]
        assert order[-1] == ROOT and order[0] != ROOT, got["order"]


def _product_body() -> dict:
    from test_fused_loss import LossGPT

    model = BMTrainModelWrapper(models.seeded(lambda: LossGPT(head="projection")), fused_loss=True)
    ids = models.token_ids()
    model(ids, ids)  # the first call
    chunks, chunk_grads = [], lce._chunk_grads
    lce._chunk_grads = lambda z, *args: (chunks.append(z.shape[0]), chunk_grads(z, *args))[1]
    try:
        with bmt.get_state().comm.trace() as ops:
            model(ids, ids).backward()
    finally:
        lce._chunk_grads = chunk_grads
    root = next(g for g in model.plan.groups if g.is_root)
    return {"order": [label for op, label, _ in ops if op == "reduce_scatter"], "chunks": chunks,
            "root_buffers": [[s.fqn for s in b.slots] for b in root.buffers]}


def test_a_fused_product_heads_gradient_is_still_reduced_before_the_blocks() -> None:
    """A custom projection's F.linear fused (its weight read as a HeadWeight) keeps its module's late gather."""
    (got,) = run_distributed(_product_body, 1)
    assert got["chunks"] and ["head.weight"] in got["root_buffers"], got  # the chunked op ran
    assert got["order"][0] == ROOT and got["order"][1] != ROOT, got["order"]
