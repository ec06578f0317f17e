"""HSDP: ``mesh=`` a 2-D (replicate, shard) DeviceMesh shards within each row and replicates across rows.

At 4 ranks as 2x2: parity with plain PyTorch (the Contracts' tolerances), all-gather bytes equal to ZeRO-3
over 2 ranks (both counted), the replicas' gradient all-reduce counted, norms over the shard group only,
a 1-D mesh identical to none, and mesh errors raised on every rank.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from dist_harness import raised, run_distributed
from parity import lm_batches, train_side_by_side, wholes
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from toy import ToyGPT

import bmt_wrap as bmt
from bmt_wrap.distributed import build_layout, job_layout
from bmt_wrap.errors import MeshError
from bmt_wrap.passes import estimate_mesh

HSDP = (2, 2)
NAMES = ("replicate", "shard")


def _mesh(shape: tuple[int, ...] = HSDP, names: tuple[str, ...] | None = NAMES) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ---- parity -----------------------------------------------------------------------------------------------
def _parity_body(model: str, optimizer: str, micro: int = 1) -> dict:
    mesh = _mesh()
    if model == "toy":
        build, batches, loss_fn = ToyGPT, lm_batches(4, 8), None
    else:
        g = torch.Generator().manual_seed(3)
        build = models.llama
        batches = [(torch.randint(0, models.VOCAB, (4, 8), generator=g),) for _ in range(3)]
        loss_fn = _hf_loss
    result = train_side_by_side(build, lambda m: bmt.BMTrainModelWrapper(m, mesh=mesh), batches,
                                optimizer=optimizer, loss_fn=loss_fn, micro=micro)
    return {"losses": result["losses"]}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["toy", "llama"])
def test_hsdp_2x2_matches_plain_pytorch(model: str, optimizer: str) -> None:
    # train_side_by_side asserts losses, gradients and parameters at every step on every rank
    results = run_distributed(_parity_body, 4, model, optimizer)
    assert all(len(r["losses"]) == len(results[0]["losses"]) > 0 for r in results)


def test_hsdp_accumulates_micro_batches_like_plain_pytorch() -> None:
    run_distributed(_parity_body, 4, "toy", "sgd", 2)


# ---- counted bytes ----------------------------------------------------------------------------------------
def _one_step_stats(use_mesh: bool) -> dict:
    torch.manual_seed(0)
    mesh = _mesh() if use_mesh else None
    model = bmt.BMTrainModelWrapper(ToyGPT(), mesh=mesh)
    layout = build_layout(job_layout(mesh)).dp
    x, y = lm_batches(1, 2 * bmt.world_size())[0]
    n, r = bmt.world_size(), bmt.rank()
    bmt.reset_comm_stats()
    model(x.chunk(n)[r], y.chunk(n)[r]).backward()
    est = estimate_mesh(model.plan, n, n // 2, n // 2) if use_mesh else None
    return {"by_group": bmt.comm_stats(by_group=True), "total": bmt.comm_stats(),
            "grad_shard_bytes": sum(p.grad.to_local().numel() * 4 for p in model.parameters()),
            "estimate": None if est is None else (est.comm_all_gather, est.comm_reduce_scatter, est.comm_replicas),
            # gloo: both groups on one worker, so each replicas' average is posted with its reduce-scatter
            "posted_together": layout.replicate is not None and layout.replicate.runs_after(layout.shard)}


def test_hsdp_gathers_what_zero3_over_the_shard_group_gathers_and_counts_the_replica_all_reduce() -> None:
    hsdp = run_distributed(_one_step_stats, 4, True)
    zero3 = run_distributed(_one_step_stats, 2, False)
    for r in hsdp:
        shard, replicate = r["by_group"]["shard"], r["by_group"]["replicate"]
        z = zero3[0]["by_group"]["world"]
        assert shard["all_gather"] == z["all_gather"], (shard, z)
        assert shard["reduce_scatter"] == z["reduce_scatter"], (shard, z)
        # One average per reduce-scatter, of the reduced shard: 2·b·(R−1)/R = b bytes for R = 2 replicas.
        assert replicate["all_reduce"]["calls"] == shard["reduce_scatter"]["calls"]
        assert replicate["all_reduce"]["bytes"] >= r["grad_shard_bytes"] > 0
        assert "all_gather" not in replicate and "reduce_scatter" not in replicate
        assert r["total"]["all_gather"] == shard["all_gather"]
        counted = (shard["all_gather"]["bytes"], shard["reduce_scatter"]["bytes"], replicate["all_reduce"]["bytes"])
        assert counted == r["estimate"], "estimate_mesh predicts the counted bytes"
        assert r["posted_together"]


# ---- norms over the shard group ---------------------------------------------------------------------------
def _clip_body() -> dict:
    torch.manual_seed(0)
    ref = ToyGPT()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), mesh=_mesh())
    x, y = lm_batches(1, 8)[0]
    ref(x, y).backward()
    n, r = bmt.world_size(), bmt.rank()
    model(x.chunk(n)[r], y.chunk(n)[r]).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    bmt_norm = model.clip_grad_norm_(1e9)
    mgr = bmt.optim.OptimManager()
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    mgr.add_optimizer(opt)
    mgr_norm = mgr.clip_grad_norm(opt.param_groups, 1e9)
    weight = next(p for p in model.parameters() if p.ndim == 2)
    ref_weight = dict(ref.named_parameters())[next(n for n, p in model.named_parameters() if p is weight)]
    return {"want": float(want), "torch": float(torch_norm), "bmt": float(bmt_norm), "mgr": float(mgr_norm),
            "param_norm": (float(weight.norm()), float(ref_weight.norm())),
            "sum": (float(weight.sum()), float(ref_weight.sum()))}


def test_clip_grad_norm_and_reductions_on_hsdp_give_plain_pytorch_values() -> None:
    for r in run_distributed(_clip_body, 4):
        for key in ("torch", "bmt", "mgr"):
            assert r[key] == pytest.approx(r["want"], rel=1e-5), (key, r)
        assert r["param_norm"][0] == pytest.approx(r["param_norm"][1], rel=1e-5)
        assert r["sum"][0] == pytest.approx(r["sum"][1], rel=1e-4, abs=1e-5)


# ---- a 1-D mesh is no mesh ------------------------------------------------------------------------------
def _trace_body(mesh_shape: tuple[int, ...] | None) -> dict:
    torch.manual_seed(0)
    mesh = _mesh(mesh_shape, None) if mesh_shape else None
    model = bmt.BMTrainModelWrapper(ToyGPT(), mesh=mesh)
    x, y = lm_batches(1, 8)[0]
    n, r = bmt.world_size(), bmt.rank()
    with bmt.get_state().comm.trace() as ops:
        loss = model(x.chunk(n)[r], y.chunk(n)[r])
        loss.backward()
    return {"ops": list(ops), "loss": float(loss),
            "grads": [p.grad.to_local().clone() for p in model.parameters()]}


def test_one_dimensional_mesh_over_the_world_equals_no_mesh() -> None:
    plain = run_distributed(_trace_body, 4, None)
    one_d = run_distributed(_trace_body, 4, (4,))
    for a, b in zip(plain, one_d, strict=True):
        assert a["ops"] == b["ops"] and a["loss"] == b["loss"]
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))


# ---- mesh validation --------------------------------------------------------------------------------------
def _bad_mesh_body(case: str) -> tuple[str, str]:
    rank = bmt.rank()
    if case == "names":
        mesh = _mesh(HSDP, ("shard", "replicate"))
    elif case == "3d":
        mesh = DeviceMesh("cpu", torch.arange(4).view(1, 2, 2), _init_backend=False)
    elif case == "differs":
        grid = [[0, 1], [2, 3]] if rank < 2 else [[0, 2], [1, 3]]
        mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=NAMES, _init_backend=False)
    elif case == "partial":
        mesh = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=NAMES, _init_backend=False)
    elif case == "1d-order":
        mesh = DeviceMesh("cpu", torch.tensor([1, 0, 2, 3]), _init_backend=False)
    else:
        mesh = "2x2"
    return raised(lambda: bmt.BMTrainModelWrapper(ToyGPT(), mesh=mesh))


@pytest.mark.parametrize("case,words", [
    ("names", "mesh_dim_names=('replicate', 'shard')"),
    ("3d", "1-D mesh"),
    ("differs", "differs across ranks"),
    ("1d-order", "in order"),
    ("partial", "cover every rank exactly once"),
    ("not-a-mesh", "init_device_mesh"),
])
def test_bad_meshes_raise_mesh_error_on_every_rank(case: str, words: str) -> None:
    for name, message in run_distributed(_bad_mesh_body, 4, case):
        assert name == MeshError.__name__, message
        assert words in message, message


# ---- wrap-time broadcast, state_dict, consolidated checkpoints, refusals ---------------------------------
def _checkpoint_body(directory: str) -> dict:
    mesh = _mesh()
    torch.manual_seed(0)
    reference = ToyGPT()
    torch.manual_seed(100 + bmt.rank())  # every rank builds different values: wrapping keeps rank 0's
    model = ToyGPT()
    if bmt.rank() == 0:
        model.load_state_dict(reference.state_dict())
    model = bmt.BMTrainModelWrapper(model, mesh=mesh)
    state = model.state_dict()
    same_as_rank0 = all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    path = f"{directory}/model.safetensors"
    bmt.save(model, path)
    torch.manual_seed(7)
    other = bmt.BMTrainModelWrapper(ToyGPT(), mesh=mesh)
    bmt.load(other, path)
    reloaded = other.state_dict()
    return {"wrap_broadcast": same_as_rank0,
            "reloaded": all(torch.equal(reloaded[k], v) for k, v in state.items())}


def test_hsdp_state_dict_and_consolidated_save_load(tmp_path) -> None:
    results = run_distributed(_checkpoint_body, 4, str(tmp_path))
    for r in results:
        assert r["wrap_broadcast"] and r["reloaded"], r
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"], "one file, written by one rank"



def _mixed_precision_body(use_mesh: bool) -> list[float]:
    torch.manual_seed(0)
    mp = bmt.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = bmt.BMTrainModelWrapper(ToyGPT(), mesh=_mesh() if use_mesh else None, mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n, r = bmt.world_size(), bmt.rank()
    losses = []
    for x, y in lm_batches(3, 8):
        loss = model(x.chunk(n)[r], y.chunk(n)[r])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(bmt.sum_loss(loss)))
    return losses


def test_mixed_precision_composes_with_hsdp() -> None:
    hsdp = run_distributed(_mixed_precision_body, 4, True)
    zero3 = run_distributed(_mixed_precision_body, 4, False)
    # bf16 compute: both layouts run the same arithmetic on the same gathered values; only the order of
    # the fp32 gradient sums differs (two-stage average against one ring).
    torch.testing.assert_close(torch.tensor(hsdp[0]), torch.tensor(zero3[0]), rtol=1e-3, atol=0)
    assert all(h == hsdp[0] for h in hsdp)


def _two_layouts_body() -> tuple[str, str]:
    first = bmt.BMTrainModelWrapper(ToyGPT(), mesh=_mesh())
    outcome = raised(lambda: bmt.BMTrainModelWrapper(ToyGPT()))
    del first
    return outcome


def test_a_second_layout_beside_a_live_hsdp_model_is_refused() -> None:
    for name, message in run_distributed(_two_layouts_body, 4):
        assert name == "UnsupportedError" and "same mesh=" in message, message



def _sharded_body(directory: str, load_shape: tuple[int, int] | None, fmt: str) -> tuple[bool, bool]:
    from bmt_wrap.checkpoint.dcp import load_sharded, save_sharded
    from bmt_wrap.runtime.process_engine import reset_engine

    if fmt == "bmt":
        def save_sharded(directory, model, opt):
            bmt.save_checkpoint(directory, model, optimizer=opt)

        def load_sharded(directory, model, opt):
            bmt.load_checkpoint(directory, model, optimizer=opt)

    def trained(mesh, seed):
        torch.manual_seed(seed)
        model = bmt.BMTrainModelWrapper(ToyGPT(), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = lm_batches(1, 8)[0]
        n, r = bmt.world_size(), bmt.rank()
        model(x.chunk(n)[r], y.chunk(n)[r]).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = trained(_mesh(), 0)
    save_sharded(directory, model, opt)
    want = model.state_dict()
    want_state = wholes([(s["exp_avg_sq"], s["exp_avg_sq"]) for s in opt.state.values()])
    del model, opt
    reset_engine()  # the loading model may use another layout
    other, other_opt = trained(_mesh(load_shape) if load_shape else None, 5)
    load_sharded(directory, other, other_opt)
    got = other.state_dict()
    got_state = wholes([(s["exp_avg_sq"], s["exp_avg_sq"]) for s in other_opt.state.values()])
    return (all(torch.equal(got[k], v) for k, v in want.items()),
            all(torch.equal(a, b) for a, b in zip(got_state, want_state, strict=True)))


@pytest.mark.parametrize("fmt", ["dcp", "bmt"])
@pytest.mark.parametrize("load_shape", [HSDP, None, (4, 1)])
def test_sharded_save_under_hsdp_loads_at_any_layout(tmp_path, load_shape, fmt: str) -> None:
    # DCP: replicas offer the same boxes, written once. bmt.save_checkpoint: the first replica writes the
    # shards, the others' ranges are empty. Either way each rank reads its own range on load.
    results = run_distributed(_sharded_body, 4, str(tmp_path / "ckpt"), load_shape, fmt)
    assert all(r == (True, True) for r in results)
    if fmt == "bmt":
        sizes = sorted(p.stat().st_size for p in (tmp_path / "ckpt").glob("shard-*.safetensors"))
        assert len(sizes) == 4 and sizes[1] < sizes[2], "two replicas' files hold no shards"


# ---- the three parts of issue 24 together -----------------------------------------------------------------
def _composed_body() -> dict:
    # HSDP 2x2, a budget that keeps every block gathered with its activations, and 4 micro-batches of which
    # the first 3 run under no_sync: one SGD step must equal plain PyTorch accumulating the same batches.
    # models.ToyGPT exports on the meta device, so the budget learns its activations at the first forward.
    mesh = _mesh()
    torch.manual_seed(0)
    ref = models.ToyGPT()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), mesh=mesh, memory_budget=2**40)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n, r = bmt.world_size(), bmt.rank()
    g = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, models.VOCAB, (2 * n, models.SEQ), generator=g) for _ in range(2))
               for _ in range(4)]
    window = []
    bmt.reset_comm_stats()
    for i, (x, y) in enumerate(batches):
        ref(x, y).div(len(batches)).backward()
        if i < len(batches) - 1:
            with model.no_sync():
                model(x.chunk(n)[r], y.chunk(n)[r]).div(len(batches)).backward()
            window.append(bmt.comm_stats().get("reduce_scatter", {"bytes": 0})["bytes"])
        else:
            model(x.chunk(n)[r], y.chunk(n)[r]).div(len(batches)).backward()
    synced = bmt.comm_stats().get("reduce_scatter", {"bytes": 0})["bytes"]
    ref_opt.step()
    opt.step()
    named = dict(ref.named_parameters())
    mine = list(model.named_parameters())
    for (name, _), value in zip(mine, wholes([(p, p) for _, p in mine]), strict=True):
        torch.testing.assert_close(value, named[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    blocks = model.plan.blocks()
    return {"window": window, "synced": synced, "kept_gathered": sum(g.zero_level == 2 for g in blocks),
            "kept_activations": sum(not g.checkpoint for g in blocks), "blocks": len(blocks)}


def test_hsdp_budget_and_no_sync_compose_like_plain_accumulation() -> None:
    for result in run_distributed(_composed_body, 4):
        assert result["window"] == [0, 0, 0], result
        assert result["synced"] > 0, result
        assert result["kept_gathered"] == result["kept_activations"] == result["blocks"] > 0, result
