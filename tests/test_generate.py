"""``model.generate`` on a wrapped transformers model: ranks that stop at different lengths do not hang,
the tokens equal plain PyTorch's, and parameters are gathered once per call when the model fits."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
from dist_harness import run_distributed

import bmt_wrap as bmt
from bmt_wrap.distributed import get_state
from bmt_wrap.gathered import sharded_groups

VOCAB = 96
NEW = 12


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # The default config with sizes shrunk and its special token ids mapped into the shrunk vocabulary
    # (dropout kept: generate runs in eval mode).
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(rank))


def _generate_body(policy: str) -> dict:
    os.environ["BMT_WRAP_GENERATE_GATHER"] = policy
    get_state().comm.timeout = timedelta(seconds=20)  # a rank left waiting fails the test fast
    torch.manual_seed(0)
    plain = _gpt2().eval()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(plain)).eval()
    rank = bmt.rank()
    # EOS is a token rank 0 generates early (and not before): rank 0 stops there, the others go on.
    # Sampled (a random tiny model repeats one token greedily), under the same seed for both models.
    torch.manual_seed(100)
    free = plain.generate(_prompt(0), max_new_tokens=NEW, do_sample=True, pad_token_id=VOCAB - 1)
    new = free[0, 5:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 2 and t not in new[:i])
    settings = dict(max_new_tokens=NEW, do_sample=True, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(100 + rank)
    want = plain.generate(_prompt(rank), **settings)
    model(_prompt(rank))  # first call: capture and schedule, outside the counted generate
    bmt.synchronize()
    bmt.reset_comm_stats()
    torch.manual_seed(100 + rank)
    got = model.generate(_prompt(rank), **settings)
    gathers = bmt.comm_stats().get("all_gather", {}).get("calls", 0)
    assert torch.equal(got, want), (got, want)
    buffers = sum(len(g.buffers) for g in sharded_groups(model))
    return {"new_tokens": want.shape[1] - 5, "gathers": gathers, "buffers": buffers}


@pytest.mark.parametrize("policy", ["once", "per-step", "auto"])
def test_generate_with_ranks_stopping_at_different_lengths(policy: str) -> None:
    results = run_distributed(_generate_body, 2, policy, timeout=120)
    lengths = [r["new_tokens"] for r in results]
    assert lengths[0] < lengths[1], lengths  # the ranks did stop at different lengths
    for r in results:
        if policy == "per-step":  # every token's forward gathers every group again
            assert r["gathers"] >= r["buffers"] * lengths[1], r
        else:  # a small model fits: gathered once for the whole call
            assert r["gathers"] == r["buffers"], r


def test_generate_on_one_rank_matches_plain() -> None:
    run_distributed(_generate_body, 1, "auto")


def _generate_first_body(name: str, tp_size: int | None) -> list[int]:
    """generate() as the wrapped model's very first call (its prefill forward is the first forward)."""
    import models
    from models import token_ids

    plain = getattr(models, name)().eval()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(plain), tp_size=tp_size).eval()
    prompt = token_ids(batch=1, seq=5, seed=3)
    settings = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = plain.generate(prompt, **settings)
    got = model.generate(prompt, **settings)
    assert torch.equal(got, want), (got, want)
    again = model.generate(prompt, **settings)  # and the schedule the first call fixed serves the next
    assert torch.equal(again, want), (again, want)
    return got[0].tolist()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("ranks,tp_size", [(1, None), (2, None), (2, 2)])
def test_generate_as_the_first_call_matches_plain(name: str, ranks: int, tp_size: int | None) -> None:
    # The first forward captures the block order on a meta copy of its inputs; generate's inputs carry a
    # KV cache (an object, not a pytree of tensors) that the meta run must not write meta tensors into.
    tokens = run_distributed(_generate_first_body, ranks, name, tp_size, timeout=180)
    assert all(t == tokens[0] for t in tokens), tokens
    assert len(tokens[0]) == 5 + NEW, tokens[0]
