"""The parameter contract (docs/design.md): a wrapped model's parameters look like the originals where user
scripts look — shape, ndim, numel, dtype — and torch's own utilities (optimizers, clip_grad_norm_,
PEFT's counts) give plain PyTorch's answers. Each test runs a training script's idiom on 2 ranks against
the same idiom on the unwrapped model in one process."""

from __future__ import annotations

import copy
import math

import models
import pytest
import torch
from dist_harness import run_distributed
from hypothesis import given
from hypothesis import strategies as st
from parity import compare_grads, compare_params, decay_groups, lm_batches, train_side_by_side, whole
from torch import nn
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.errors import ShardedTensorError
from bmt_wrap.runtime.sharded_tensor import ShardedTensor


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _gpt2_batches(steps: int = 3) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, models.VOCAB, (4, 8), generator=g),) for _ in range(steps)]


# ---- (5) what a script sees: names, shapes, ndim, dtypes ------------------------------------------------
def _signature(model: nn.Module) -> dict[str, tuple]:
    return {n: (tuple(p.shape), p.ndim, p.dim(), p.numel(), p.dtype, p.requires_grad)
            for n, p in model.named_parameters()}


def _shapes_body(name: str) -> bool:
    build = {"gpt2": models.gpt2, "llama": models.llama, "cnn": lambda: models.seeded(models.ResNetStage)}[name]
    ref = build()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    assert _signature(model) == _signature(ref)
    assert all(isinstance(p, ShardedTensor) and isinstance(p, nn.Parameter) for p in model.parameters())
    # Each rank holds a part; together the parts are the whole (counted over the local ranges).
    local = torch.tensor([float(sum(p.to_local().numel() for p in model.parameters()))])
    torch.distributed.all_reduce(local)
    assert int(local.item()) == sum(p.numel() for p in ref.parameters())
    return True


@pytest.mark.parametrize("name", ["gpt2", "llama", "cnn"])
def test_parameters_keep_the_originals_names_shapes_and_dtypes(name: str) -> None:
    assert all(run_distributed(_shapes_body, 2, name))


# ---- (4) size counts ----------------------------------------------------------------------------------
def _count_body() -> dict:
    from peft import LoraConfig, get_peft_model

    ref = get_peft_model(models.llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    return {"numel": (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in ref.parameters())),
            "peft": (model.get_nb_trainable_parameters(), ref.get_nb_trainable_parameters())}


def test_size_counts_and_peft_trainable_count_equal_plain() -> None:
    for r in run_distributed(_count_body, 2):
        assert r["numel"][0] == r["numel"][1]
        assert r["peft"][0] == r["peft"][1] and r["peft"][0][0] < r["peft"][0][1]


# ---- (1) weight-decay groups of well-known scripts -----------------------------------------------------
def _decay_body(style: str) -> dict:
    ref = models.gpt2()
    wrapped = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    mine = [(len(g["params"]), sum(p.numel() for p in g["params"])) for g in decay_groups(style, wrapped, 0.1)]
    theirs = [(len(g["params"]), sum(p.numel() for p in g["params"])) for g in decay_groups(style, ref, 0.1)]
    assert mine == theirs, (mine, theirs)
    result = train_side_by_side(models.gpt2, bmt.BMTrainModelWrapper, _gpt2_batches(), optimizer=style,
                                loss_fn=_lm_loss, sliced_reference=True)
    return {"groups": mine, "param_diff": result["param_diff"]}


@pytest.mark.parametrize("style", ["nanogpt", "timm"])
def test_weight_decay_groups_by_dimension_match_plain(style: str) -> None:
    groups = run_distributed(_decay_body, 2, style)[0]["groups"]
    assert all(n > 0 for n, _ in groups), f"both groups hold parameters: {groups}"


# ---- (2) torch.nn.utils.clip_grad_norm_ ----------------------------------------------------------------
def _clip_body(norm_type: float, foreach: bool | None) -> list[float]:
    torch.manual_seed(0)
    ref = ToyGPT(n_layers=3)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    rank, n = bmt.rank(), bmt.world_size()
    norms = []
    for step, (x, y) in enumerate(lm_batches(3, 8)):
        ref(x, y).backward()
        model(x.chunk(n)[rank], y.chunk(n)[rank]).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
        assert not isinstance(got, ShardedTensor)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert float(want) > 0.05, "the test clips"
        compare_grads(ref, model, f"step {step} after clipping")
        norms.append(float(got))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    compare_params(ref, model, "sgd", "after clipped training")
    return norms


@pytest.mark.parametrize("norm_type,foreach", [(2.0, None), (2.0, False), (math.inf, None), (1.0, False)])
def test_torch_clip_grad_norm_clips_like_plain_on_every_rank(norm_type: float, foreach: bool | None) -> None:
    per_rank = run_distributed(_clip_body, 2, norm_type, foreach)
    assert per_rank[0] == per_rank[1], "every rank gets the same norm"


# ---- (3) an optimizer built before wrapping -------------------------------------------------------------
def _before_wrap_body(kind: str) -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(n_layers=3)
    model = copy.deepcopy(ref)
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
            "bmt-adam": lambda m: bmt.optim.AdamOptimizer(m.parameters(), lr=1e-3, weight_decay=0.1)}[kind]
    ref_opt, opt = make(ref), make(model)
    batches = lm_batches(4, 8)
    # One plain step first, so state built before wrapping must be carried over too.
    for m, o in ((ref, ref_opt), (model, opt)):
        m(*batches[0]).backward()
        o.step()
        o.zero_grad()
    model = bmt.BMTrainModelWrapper(model)  # the DDP habit: the optimizer already exists
    rank, n = bmt.rank(), bmt.world_size()
    for x, y in batches[1:]:
        ref(x, y).backward()
        model(x.chunk(n)[rank], y.chunk(n)[rank]).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    compare_params(ref, model, "sgd" if kind == "sgd" else "adamw", "after training")
    return {"rebound": all(isinstance(p, ShardedTensor) for g in opt.param_groups for p in g["params"])}


@pytest.mark.parametrize("kind", ["sgd", "adamw", "bmt-adam"])
def test_optimizer_built_before_wrapping_trains_like_plain(kind: str) -> None:
    assert all(r["rebound"] for r in run_distributed(_before_wrap_body, 2, kind))


# ---- what else a sharded parameter answers, and what it refuses -----------------------------------------
def _ops_body() -> dict:
    torch.manual_seed(0)
    ref = ToyGPT(n_layers=3)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    p, rp = model.get_parameter("layers.0.fc.weight"), ref.get_parameter("layers.0.fc.weight")
    torch.testing.assert_close(p.full_tensor(), rp.detach())
    for reduce in (torch.sum, torch.mean, torch.max, torch.min, torch.linalg.vector_norm):
        torch.testing.assert_close(reduce(p.detach()), reduce(rp.detach()), rtol=1e-6, atol=1e-6)
    assert torch.equal(p, rp) and not torch.equal(p, rp + 1)
    with torch.no_grad():
        q = p * 2 + rp  # a plain operand of the full shape is read at this rank's range
        torch.testing.assert_close(whole(q), rp * 3)
        torch.manual_seed(7)
        nn.init.trunc_normal_(p, std=0.02)
        torch.manual_seed(7)
        nn.init.trunc_normal_(rp, std=0.02)
    torch.testing.assert_close(p.full_tensor(), rp.detach(), rtol=0, atol=0)
    # Ops with no local answer gather this parameter's full value and return plain tensors.
    bmt.reset_comm_stats()
    full = rp.detach()
    cases = [(lambda: p @ torch.ones(p.shape[1]), full @ torch.ones(p.shape[1])), (lambda: p[0], full[0]),
             (lambda: p.t(), full.t()), (lambda: p.softmax(-1), full.softmax(-1)),
             (lambda: torch.ones(p.shape).copy_(p), full), (lambda: p.norm(dim=-1), full.norm(dim=-1)),
             (lambda: p.sum(0), full.sum(0)),
             (lambda: p.reshape(p.shape[1], -1).mT, full.reshape(p.shape[1], -1).mT)]
    for op, want in cases:
        got = op()
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    materialized = bmt.comm_stats()["materialize"]
    flat = p.view(-1)  # the same range under another shape: no communication
    assert isinstance(flat, ShardedTensor) and flat.shape == (p.numel(),) and flat.to_local() is not None
    with torch.no_grad():
        p.copy_(p.t().t() * 2)  # a full-shape plain value written into a sharded one keeps the range
    torch.testing.assert_close(p.full_tensor(), full * 2)
    return {"materialized": materialized["calls"], "bytes": materialized["bytes"], "numel": p.numel()}


def test_sharded_parameters_answer_reductions_and_materialise_the_rest() -> None:
    for r in run_distributed(_ops_body, 2):
        assert r["materialized"] == 8 and r["bytes"] == 8 * 4 * r["numel"], "one gather of this slot per op"


def _elementwise_body(shape: list[int], dtype: str) -> bool:
    dt = getattr(torch, dtype)
    torch.manual_seed(len(shape))
    full = torch.randn(shape).to(dt)
    p = bmt.DistributedParameter(full.clone())
    torch.testing.assert_close(whole(p.detach() * 3 - 1), full * 3 - 1)
    torch.testing.assert_close(torch.linalg.vector_norm(p.detach(), dtype=torch.float32),
                               torch.linalg.vector_norm(full, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    norms = torch._foreach_norm([p.detach(), p.detach() * 2])
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(torch._foreach_norm([full, full * 2])).float(),
                               rtol=2 ** -7 if dt != torch.float32 else 1e-6, atol=1e-5)  # bf16: one ulp
    return p.shape == full.shape and p.numel() == full.numel()


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "bfloat16"]),
       world_size=st.sampled_from([1, 2]))
def test_elementwise_and_norms_over_any_shape_match_the_full_tensor(shape: list[int], dtype: str,
                                                                     world_size: int) -> None:
    assert all(run_distributed(_elementwise_body, world_size, shape, dtype))



# ---- stock DDP (what stock Trainer, accelerate and Lightning's ddp put around a model) ------------------
def _ddp_body() -> str:
    model = bmt.BMTrainModelWrapper(ToyGPT(n_layers=2))
    with pytest.raises(ShardedTensorError) as info:
        torch.nn.parallel.DistributedDataParallel(model)
    return str(info.value)


def test_stock_ddp_around_a_wrapped_model_names_the_integrations_on_every_rank() -> None:
    for message in run_distributed(_ddp_body, 2):
        assert "DistributedDataParallel was put around a wrapped model" in message
        for name in ("integrations.transformers.Trainer", "integrations.accelerate.Accelerator",
                     "integrations.lightning.ShardedStrategy"):
            assert name in message
