"""``BMTrainModelWrapper(model, tp_size=T)`` on 4 gloo ranks: parity with plain PyTorch at tp2 x dp2,
tp4 x dp1 and tp1 x dp4 (losses, gathered gradients, final parameters; the Contracts' tolerances), bytes
counted equal to the plan's, named errors on every rank, and composition with memory_budget=, no_sync(),
save and the ("dp", "tp") mesh; tp_size= with a 2-D HSDP mesh points to the 3-D mesh (test_mesh3d.py)."""

from __future__ import annotations

import math

import models
import pytest
import torch
from dist_harness import COMM_TIMEOUT, raised, run_distributed
from parity import lm_batches, no_sync_two_halves, train_side_by_side, wholes
from test_tp_plan import NO_HEAD_PLAN, TOY_PLAN, HelperHeadGPT

import bmt_wrap as bmt
from bmt_wrap.errors import MeshError

WORLD = 4



def llama_mha() -> torch.nn.Module:
    """``models.llama()`` with as many key/value heads as query heads (4), so tp_size=4 divides them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**models._hf_small(), "num_key_value_heads": 4})
    return models.seeded(lambda: LlamaForCausalLM(config))


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _setup(name: str, steps: int = 3, batch: int = 4):
    """(build, batches, loss_fn, tp_plan) for the toy GPT (a user plan), the Llama (its own plan) or GPT-2
    (Conv1D MLP pairs derived from the graph)."""
    if name == "toy":
        return models.ToyGPT, lm_batches(steps, batch), None, TOY_PLAN
    if name == "toy_tied":  # embedding and head share one weight: both split by vocabulary rows, one slice
        return lambda: models.ToyGPT(tie=True), lm_batches(steps, batch), None, TOY_PLAN
    if name == "functional_tied":  # no head module: the root's F.linear(h, embed.weight) computes the logits
        return models.FunctionalTiedGPT, lm_batches(steps, batch), None, NO_HEAD_PLAN
    if name == "toy_derived":  # no plan: the MLP pairs found in the blocks' graphs are split
        return models.ToyGPT, lm_batches(steps, batch), None, None
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, models.VOCAB, (batch, 8), generator=g),) for _ in range(steps)]
    return {"llama": llama_mha, "gpt2": models.gpt2}[name], batches, _hf_loss, None


def _parity_body(name: str, tp: int, optimizer: str, world: int = WORLD) -> dict:
    build, batches, loss_fn, tp_plan = _setup(name)
    rank, wrapped = bmt.rank(), []

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(bmt.BMTrainModelWrapper(m, tp_size=tp, tp_plan=tp_plan))
        return wrapped[0]

    result = train_side_by_side(build, wrap, batches, optimizer=optimizer, loss_fn=loss_fn,
                                data_parallel=(rank // tp, world // tp))
    return {"losses": result["losses"], "grad_diff": result["grad_diff"], "param_diff": result["param_diff"],
            "plan": str(wrapped[0].plan), "split": {n: (list(p.shape), getattr(p, "_tp_split_dim", None))
                                                   for n, p in wrapped[0].named_parameters()}}


@pytest.mark.parametrize("tp", [2, 4, 1])
@pytest.mark.parametrize("name", ["toy", "llama"])
def test_tp_matches_plain_pytorch_sgd(name: str, tp: int) -> None:
    # train_side_by_side asserts losses, whole gradients and parameters at every step, on every rank
    results = run_distributed(_parity_body, WORLD, name, tp, "sgd")
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert len(results[0]["losses"]) == 3


@pytest.mark.parametrize("name", ["toy_tied", "toy_derived"])
def test_tp2_tied_embedding_and_derived_plan_match_plain_pytorch(name: str) -> None:
    results = run_distributed(_parity_body, WORLD, name, 2, "sgd")
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_tp2_embedding_read_by_the_roots_f_linear_stays_whole_and_matches_plain_pytorch(world: int) -> None:
    # tp2 alone (2 ranks) and tp2 x dp2 (4). Before: embed was split by vocabulary rows, so the root's
    # F.linear(h, self.embed.weight) computed this rank's 48 of the 96 logits (cross-entropy then failed
    # on the targets beyond them; any other read of the logits was silently wrong).
    results = run_distributed(_parity_body, world, "functional_tied", 2, "sgd", world)
    for r in results:
        assert r["losses"] == results[0]["losses"] and len(r["losses"]) == 3
        assert "replicated embed: the root's forward (FunctionalTiedGPT) reads embed.weight itself" in r["plan"]
        assert r["split"]["embed.weight"] == ([models.VOCAB, models.DIM], None)
        assert r["split"]["layers.0.fc1.weight"] == ([2 * models.DIM, models.DIM], 0)  # the rest stays split


@pytest.mark.parametrize("name", ["toy", "llama"])
def test_tp2_matches_plain_pytorch_adamw(name: str) -> None:
    results = run_distributed(_parity_body, WORLD, name, 2, "adamw")
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.parametrize(("world", "optimizer"), [(2, "adamw"), (4, "adamw"), (4, "sgd")])
def test_gpt2_conv1d_split_matches_plain_pytorch(world: int, optimizer: str) -> None:
    # tp2 alone (2 ranks) and tp2 x dp2 (4): GPT-2's MLP Conv1Ds split column -> row with the weight
    # transposed, and its attention as Megatron splits a fused q/k/v: c_attn strided (each rank its heads'
    # slice of q, of k and of v), c_proj by rows, split_size and num_heads halved; losses, whole gradients
    # at every step and parameters after AdamW (train_side_by_side asserts them on every rank, joining a
    # strided slice block by block: tests/parity.py).
    # SGD's elementwise parameter check is the one that catches a sum in place of an average.
    results = run_distributed(_parity_body, world, "gpt2", 2, optimizer, world)
    assert all(r["losses"] == results[0]["losses"] for r in results) and len(results[0]["losses"]) == 3
    for r in results:
        assert "split transformer.h.0.mlp.c_fc: colwise" in r["plan"]
        assert "split transformer.h.1.mlp.c_proj: rowwise" in r["plan"]
        assert "split transformer.h.0.attn.c_attn: colwise (strided: each of 3 fused blocks cut)" in r["plan"]
        assert "split transformer.h.1.attn.c_proj: rowwise" in r["plan"]
        assert "heads transformer.h.0.attn.split_size: 32 -> 16" in r["plan"]
        assert "heads transformer.h.0.attn.num_heads: 4 -> 2" in r["plan"]
        assert r["split"]["transformer.h.0.mlp.c_fc.weight"] == ([32, 64], 1)
        assert r["split"]["transformer.h.0.mlp.c_fc.bias"] == ([64], 0)
        assert r["split"]["transformer.h.0.mlp.c_proj.weight"] == ([64, 32], 0)
        assert r["split"]["transformer.h.0.mlp.c_proj.bias"] == ([32], None)
        assert r["split"]["transformer.h.0.attn.c_attn.weight"] == ([32, 48], 1)
        assert r["split"]["transformer.h.0.attn.c_attn.bias"] == ([48], 0)
        assert r["split"]["transformer.h.0.attn.c_proj.weight"] == ([16, 32], 0)


def _split_body() -> dict:
    model = bmt.BMTrainModelWrapper(models.ToyGPT(), tp_size=2, tp_plan=TOY_PLAN)
    q = model.layers[0].attn.q.weight
    saved = bmt.WrapPlan.from_json(model.plan.to_json())
    again = bmt.BMTrainModelWrapper(models.ToyGPT(), tp_size=2, plan=saved)
    return {"q": (list(q.shape), q._tp_split_dim, list(q._tp_original_shape)),
            "heads": model.layers[0].attn.heads, "o_bias": list(model.layers[0].attn.o.bias.shape),
            "split": len(model.plan.tensor_parallel.entries),
            "shown": "split layers.0.attn.q: colwise" in str(model.plan),
            "replanned": again.plan.tensor_parallel == model.plan.tensor_parallel
            and list(again.layers[0].attn.q.weight.shape) == [16, 32]}


def test_parameters_are_split_marked_shown_and_replanned() -> None:
    results = run_distributed(_split_body, WORLD)
    want = {"q": ([16, 32], 0, [32, 32]), "heads": 2, "o_bias": [32], "split": 4 * 6 + 2, "shown": True,
            "replanned": True}
    assert all(r == want for r in results), results


def _bytes_body(name: str, tp: int) -> dict:
    from bmt_wrap import passes

    build, batches, loss_fn, tp_plan = _setup(name, steps=1)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(build(), tp_size=tp, tp_plan=tp_plan)
    ids = batches[0][0].chunk(WORLD // tp)[bmt.rank() // tp]
    run = loss_fn or (lambda m, *b: m(*b))
    local = tuple(t.chunk(WORLD // tp)[bmt.rank() // tp] for t in batches[0])
    run(model, *local).backward()  # the first step fixes the schedule; count the second
    bmt.reset_comm_stats()
    run(model, *local).backward()
    counted = bmt.comm_stats(by_group=True)
    plan = model.plan
    est = passes.estimate_tp(plan, WORLD // tp, tokens=ids.numel())
    return {"counted": counted, "est": est, "tp_plan": plan.tensor_parallel.traffic(
        ids.numel(), 4, {g.name for g in plan.blocks() if g.checkpoint})}


@pytest.mark.parametrize("name", ["toy", "llama"])
def test_counted_bytes_equal_plan(name: str) -> None:
    for r in run_distributed(_bytes_body, WORLD, name, 2):
        counted, est = r["counted"], r["est"]
        # TP: activations all-reduced and gathered over the TP pair, exactly the plan's section
        assert {op: v["bytes"] for op, v in counted["tp"].items()} == {
            op: b for op, b in r["tp_plan"].items() if b}
        # ZeRO over the dp pair, and the used-parameter mask over the job: the plan's estimate, byte for byte
        assert counted["dp"]["all_gather"]["bytes"] + r["tp_plan"]["all_gather"] == est.comm_all_gather
        assert counted["dp"]["reduce_scatter"]["bytes"] == est.comm_reduce_scatter
        assert counted["world"]["all_reduce"]["bytes"] + r["tp_plan"]["all_reduce"] == est.comm_all_reduce
        assert sum(v["bytes"] for ops in counted.values() for v in ops.values()) == est.comm_total
        assert est.comm_tp == sum(r["tp_plan"].values()) > 0


def _mismatch_body() -> tuple[str, str]:
    model = bmt.BMTrainModelWrapper(models.ToyGPT(), tp_size=2, tp_plan=TOY_PLAN)
    ids = torch.full((1, 8), bmt.rank() % 2, dtype=torch.long)  # TP peers differ
    return raised(lambda: model(ids, ids))


def test_tp_peers_with_different_batches_raise_on_every_rank() -> None:
    results = run_distributed(_mismatch_body, WORLD)
    assert all(kind != "ok" and "differ" in msg for kind, msg in results), results


def _unseen_read_body() -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model = bmt.BMTrainModelWrapper(HelperHeadGPT(), tp_size=2, tp_plan=NO_HEAD_PLAN)
    first_call = raised(lambda: model(ids, ids))
    plan = bmt.BMTrainModelWrapper(models.FunctionalTiedGPT(), tp_size=2, tp_plan=NO_HEAD_PLAN).plan
    other = bmt.passes.plan_tensor_parallel(models.ToyGPT(n_layers=2), 2,
                                            bmt.passes.discover_blocks(models.ToyGPT(n_layers=2)), NO_HEAD_PLAN)
    plan.tensor_parallel.entries += [e for e in other.entries if e.module == "embed"]  # an edited plan=
    edited = raised(lambda: bmt.BMTrainModelWrapper(models.FunctionalTiedGPT(), tp_size=2, plan=plan))
    return {"first_call": first_call, "edited": edited}


def test_a_split_weight_read_unseen_at_wrap_time_raises_at_the_first_call_on_every_rank() -> None:
    # The pass cannot see the read (fx cannot trace the root; a function given the module reads its
    # weight), so the first call's export graph refuses it; a plan= splitting a weight read elsewhere is
    # refused at wrap time.
    for r in run_distributed(_unseen_read_body, 2):
        assert r["first_call"][0] == "TensorParallelPlanError", r
        assert "embed.weight (split by 'embed') is also read by the root's forward" in r["first_call"][1]
        assert r["edited"][0] == "TensorParallelPlanError" and "plan= splits 'embed'" in r["edited"][1], r


def _not_divisible_body() -> tuple[str, str]:
    return raised(lambda: bmt.BMTrainModelWrapper(models.llama(), tp_size=4))


def test_not_divisible_raises_on_every_rank() -> None:
    results = run_distributed(_not_divisible_body, WORLD)
    assert all(r == ("TensorParallelPlanError", results[0][1]) and "num_key_value_heads = 2" in r[1]
               for r in results), results


def _hsdp_body() -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), tp_size=2, mesh=mesh))


def test_tp_size_with_a_2d_hsdp_mesh_points_to_the_3d_mesh() -> None:
    # A (replicate, shard) mesh covers every rank without a TP dim: the 3-D mesh names it (test_mesh3d.py)
    results = run_distributed(_hsdp_body, WORLD)
    assert all(r[0] == MeshError.__name__ and "('replicate', 'shard', 'tp')" in r[1] for r in results), results


def _mesh_body() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    build, batches, loss_fn, tp_plan = _setup("toy")
    result = train_side_by_side(build, lambda m: bmt.BMTrainModelWrapper(m, mesh=mesh, tp_plan=tp_plan),
                                batches, data_parallel=(bmt.rank() // 2, 2))
    return {"losses": result["losses"]}


def test_dp_tp_mesh_matches_plain_pytorch() -> None:
    results = run_distributed(_mesh_body, WORLD)
    assert all(len(r["losses"]) == 3 for r in results)


def _budget_body() -> dict:
    build, batches, loss_fn, tp_plan = _setup("toy")
    result = train_side_by_side(
        build, lambda m: bmt.BMTrainModelWrapper(m, tp_size=2, tp_plan=tp_plan, memory_budget=2**30,
                                                 example_inputs=batches[0][0][:2]),
        batches, data_parallel=(bmt.rank() // 2, 2))
    return {"losses": result["losses"]}


def test_tp_with_memory_budget_matches_plain_pytorch() -> None:
    results = run_distributed(_budget_body, WORLD)
    assert all(len(r["losses"]) == 3 for r in results)


def _no_sync_body() -> dict:
    build, batches, _, tp_plan = _setup("toy", steps=1, batch=8)
    torch.manual_seed(0)
    ref = build()
    import copy

    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), tp_size=2, tp_plan=tp_plan)
    no_sync_two_halves(model, ref, batches[0], bmt.rank() // 2, 2)
    worst = 0.0
    refs = dict(ref.named_parameters())
    named = list(model.named_parameters())
    for (name, _), grad in zip(named, wholes([(p.grad, p) for _, p in named]), strict=True):
        torch.testing.assert_close(grad, refs[name].grad, rtol=1e-5, atol=1e-6)
        worst = max(worst, float((grad - refs[name].grad).abs().max()))
    return {"worst": worst}


def test_tp_no_sync_accumulates_like_plain_pytorch() -> None:
    results = run_distributed(_no_sync_body, WORLD)
    assert all(r["worst"] < 1e-5 for r in results)


def _save_body(path: str) -> dict:
    ref = models.seeded(models.ToyGPT)
    model = bmt.BMTrainModelWrapper(models.seeded(models.ToyGPT), tp_size=2, tp_plan=TOY_PLAN)
    bmt.save(model, path)
    bmt.synchronize()
    plain = models.seeded(models.ToyGPT, seed=1)
    bmt.load(plain, path)
    state = model.state_dict()
    other = bmt.BMTrainModelWrapper(models.seeded(models.ToyGPT, seed=1), tp_size=2, tp_plan=TOY_PLAN)
    bmt.load(other, path)  # the full file into TP slices
    loaded = other.state_dict()
    return {"same_file": all(torch.equal(p, ref.state_dict()[n]) for n, p in plain.state_dict().items()),
            "same_state": all(torch.equal(state[n], ref.state_dict()[n]) and torch.equal(loaded[n], state[n])
                              for n in ref.state_dict()),
            "shapes": {n: list(t.shape) for n, t in state.items()} == {n: list(t.shape) for n, t in
                                                                      ref.state_dict().items()}}


def test_tp_save_writes_full_tensors_and_loads_into_slices(tmp_path) -> None:
    results = run_distributed(_save_body, WORLD, str(tmp_path / "tp.safetensors"))
    assert all(r == {"same_file": True, "same_state": True, "shapes": True} for r in results), results


def _bad_layout_body(kind: str) -> tuple[str, str]:
    if kind == "tp3":  # 4 ranks are not a multiple of 3
        return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), tp_size=3))
    if kind == "init_tp3":  # the same size asked of init_distributed (the harness's other arguments)
        return raised(lambda: bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=3))
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))  # TP peers not adjacent
    return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), mesh=mesh))


@pytest.mark.parametrize("kind, error, words", [
    # Issue 49: the wrapper's tp_size= named init_distributed(tp_size=3), a call the user never made.
    ("tp3", "InitError", "BMTrainModelWrapper(..., tp_size=3): the world size 4 must be a multiple of tp_size"),
    ("init_tp3", "InitError", "init_distributed(tp_size=3): the world size 4 must be a multiple of tp_size"),
    ("mesh", "MeshError", "adjacent")])
def test_bad_tp_layout_raises_on_every_rank(kind: str, error: str, words: str) -> None:
    results = run_distributed(_bad_layout_body, WORLD, kind)
    assert all(r[0] == error and words in r[1] for r in results), results


def _norm_body(tp: int) -> dict:
    import copy

    build, batches, _, tp_plan = _setup("toy", steps=1)
    torch.manual_seed(0)
    ref = build()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), tp_size=tp, tp_plan=tp_plan)
    dp = WORLD // tp
    ids, tgt = (t.chunk(dp)[bmt.rank() // tp] for t in batches[0])
    model(ids, tgt).backward()
    ref(*batches[0]).backward()
    clip = torch.nn.utils.clip_grad_norm_
    kinds = {"2": (2.0, None), "2 foreach=False": (2.0, False), "inf": (math.inf, None), "1": (1.0, None)}
    return {"ours": float(model.clip_grad_norm_(1e9)),
            "torch": {k: float(clip(model.parameters(), 1e9, norm_type=n, foreach=f)) for k, (n, f) in kinds.items()},
            "ref": {k: float(clip(ref.parameters(), 1e9, norm_type=n, foreach=f)) for k, (n, f) in kinds.items()}}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_grad_norms_are_plain_pytorchs(tp: int) -> None:
    # model.clip_grad_norm_ (and OptimManager's) and torch's own clip_grad_norm_ (norms 2, inf and 1, foreach
    # or not): split parameters' slices combined over TP, replicated ones once; at tp4 the dp group is one rank
    for r in run_distributed(_norm_body, WORLD, tp):
        assert r["ours"] == pytest.approx(r["ref"]["2"], rel=1e-5)
        for kind, value in r["ref"].items():
            assert r["torch"][kind] == pytest.approx(value, rel=1e-5), kind


def _fused_qkv_body() -> dict:
    from test_tp_plan import GPT2_ATTN_PLAN

    alone = raised(lambda: bmt.BMTrainModelWrapper(models.gpt2(), tp_size=2,
                                                    tp_plan={"transformer.h.*.attn.c_attn": "colwise"}))
    torch.manual_seed(1)
    ids = torch.randint(0, models.VOCAB, (2, 8))
    plain = models.gpt2()
    model = bmt.BMTrainModelWrapper(models.gpt2(), tp_size=2, tp_plan=GPT2_ATTN_PLAN)
    with torch.no_grad():
        same = torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    return {"alone": alone, "same": same, "heads": model.transformer.h[0].attn.num_heads}


def test_splitting_gpt2s_fused_qkv_is_strided_and_alone_a_named_error_on_every_rank() -> None:
    # Before: any tp_plan= naming c_attn was refused (a plain column split gave a rank whole q and half
    # of k). Now it is split strided, with c_proj by rows; c_attn split with c_proj left whole is refused
    # at wrap time, on every rank, naming both.
    for r in run_distributed(_fused_qkv_body, 2):
        kind, message = r["alone"]
        assert kind == "TensorParallelPlanError" and "transformer.h.0.attn.c_attn" in message, r
        assert "'transformer.h.0.attn.c_proj'" in message, r
        assert r["same"] and r["heads"] == 2, r


def _whole_layout_body(name: str) -> dict:
    build, _, _, tp_plan = _setup(name)
    model = bmt.BMTrainModelWrapper(build(), tp_size=2, tp_plan=tp_plan)
    whole = {n: (p.to_local().numel(), p.numel()) for n, p in model.named_parameters()
             if getattr(p, "_tp_split_dim", None) is None}
    buffers = [(b.shard.numel(), b.spec.padded_numel(WORLD), True)
               for g in model._bmt_runtime.groups for b in g.buffers if getattr(b.spec, "over_tp", False)]
    return {"whole": whole, "buffers": buffers}


@pytest.mark.parametrize("name", ["toy", "llama", "gpt2"])
def test_whole_parameters_are_sharded_over_every_rank(name: str) -> None:
    # #38 item 5: at tp2 x dp2 a parameter TP does not split is sharded over all 4 ranks (1/4 each), not over
    # the dp pair with each TP peer holding the same half; its buffers' shards are a quarter of the buffer.
    results = run_distributed(_whole_layout_body, WORLD, name)
    names = results[0]["whole"]
    assert names, "no whole parameters"
    for n, (_, numel) in names.items():
        assert sum(r["whole"][n][0] for r in results) == numel, n  # every element once, on one rank
    for r in results:
        assert r["buffers"] and all(shard == padded // WORLD for shard, padded, _ in r["buffers"])
        assert sum(v[0] for v in r["whole"].values()) <= sum(shard for shard, _, _ in r["buffers"])
