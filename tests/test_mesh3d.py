"""``BMTrainModelWrapper(model, mesh=...)`` with a 3-D ("replicate", "shard", "tp") mesh on 8 gloo ranks
(2 x 2 x 2): HSDP across replicas, ZeRO-3 within a shard group, TP between adjacent ranks. The toy GPT and
a transformers Llama match plain PyTorch (losses, whole gradients and parameters at every step under SGD,
torch's clip_grad_norm_), the bytes counted on each mesh axis are the plan's, and checkpoints saved under
the mesh resume exactly at another layout. Tiny models: 8 processes share this machine's 2 cores."""

from __future__ import annotations

import math

import models
import pytest
import torch
from dist_harness import raised, run_distributed
from parity import lm_batches, train_side_by_side
from test_tp_plan import TOY_PLAN
from test_tp_wrap import llama_mha

import bmt_wrap as bmt

WORLD, REPLICAS, SHARD, TP = 8, 2, 2, 2
DP = REPLICAS * SHARD  # data-parallel ranks: one batch slice per (replica, shard rank)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REPLICAS, SHARD, TP), mesh_dim_names=("replicate", "shard", "tp"))


def _setup(name: str, steps: int = 2):
    """(build, batches, loss_fn, tp_plan): the toy GPT with a user plan, or the Llama with its own."""
    if name.startswith("toy"):  # "toy_sp": with sequence_parallel=True
        return (lambda: models.ToyGPT(n_layers=2)), lm_batches(steps, DP), None, TOY_PLAN
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, models.VOCAB, (DP, 8), generator=g),) for _ in range(steps)]
    return llama_mha, batches, (lambda m, ids: m(input_ids=ids, labels=ids).loss), None


def _clip_norms(model: torch.nn.Module, ref: torch.nn.Module, batch: tuple, loss_fn) -> dict:
    """torch's clip_grad_norm_ (norms 2 and inf) on the wrapped model and on plain PyTorch after one more
    backward of the same global batch, and the wrapper's own."""
    run = loss_fn or (lambda m, *b: m(*b))
    dp_rank = bmt.rank() // TP  # TP peers share one slice; replicas and shard ranks each get their own
    run(model, *(t.chunk(DP)[dp_rank] for t in batch)).backward()
    run(ref, *batch).backward()
    clip = torch.nn.utils.clip_grad_norm_
    return {"ours": float(model.clip_grad_norm_(1e9)),
            "torch": {p: float(clip(model.parameters(), 1e9, norm_type=p)) for p in (2.0, math.inf)},
            "ref": {p: float(clip(ref.parameters(), 1e9, norm_type=p)) for p in (2.0, math.inf)}}


def _parity_body(name: str) -> dict:
    build, batches, loss_fn, tp_plan = _setup(name)
    wrapped: list[torch.nn.Module] = []

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(bmt.BMTrainModelWrapper(m, mesh=_mesh(), tp_plan=tp_plan, sequence_parallel=name == "toy_sp"))
        return wrapped[0]

    # asserts losses, whole gradients at every step and parameters after training, on every rank
    result = train_side_by_side(build, wrap, batches, optimizer="sgd", loss_fn=loss_fn,
                                data_parallel=(bmt.rank() // TP, DP))
    model, ref = wrapped[0], build()
    ref.load_state_dict(model.state_dict())  # the trained weights, whole (a collective)
    model.zero_grad()
    norms = _clip_norms(model, ref, batches[0], loss_fn)
    return {"losses": result["losses"], "norms": norms, "split": model.plan.tensor_parallel.tp_size}


@pytest.mark.parametrize("name", ["toy", "llama", "toy_sp"])
def test_3d_mesh_matches_plain_pytorch(name: str) -> None:
    results = run_distributed(_parity_body, WORLD, name, timeout=600)
    assert all(r["losses"] == results[0]["losses"] for r in results) and len(results[0]["losses"]) == 2
    for r in results:
        assert r["split"] == TP
        assert r["norms"]["ours"] == pytest.approx(r["norms"]["ref"][2.0], rel=1e-5)
        for p, value in r["norms"]["ref"].items():
            assert r["norms"]["torch"][p] == pytest.approx(value, rel=1e-5), p


def _bytes_body(name: str) -> dict:
    from bmt_wrap import passes

    build, batches, loss_fn, tp_plan = _setup(name, steps=1)
    model = bmt.BMTrainModelWrapper(models.seeded(build), mesh=_mesh(), tp_plan=tp_plan,
                                    sequence_parallel=name == "toy_sp")
    local = tuple(t.chunk(DP)[bmt.rank() // TP] for t in batches[0])
    run = loss_fn or (lambda m, *b: m(*b))
    run(model, *local).backward()  # the first step fixes the schedule; count the second
    bmt.reset_comm_stats()
    run(model, *local).backward()
    layout = bmt.distributed.parallel_layout().dp
    est = passes.estimate_mesh(model.plan, WORLD, SHARD, SHARD * TP, tokens=local[0].numel(),
                               shard_rank=layout.shard_rank)
    return {"counted": bmt.comm_stats(by_group=True), "est": est}


@pytest.mark.parametrize("name", ["toy", "toy_sp"])
def test_bytes_on_each_mesh_axis_are_the_plans(name: str) -> None:
    for r in run_distributed(_bytes_body, WORLD, name, timeout=600):
        counted, est = r["counted"], r["est"]

        def axis(scope: str, counted: dict = counted) -> int:
            return sum(v["bytes"] for v in counted.get(scope, {}).values())

        # ZeRO-3 within the shard pair: gathers and reduce-scatters; HSDP: the gradient shards averaged across
        # the replica pair; TP: the activations' all-reduces and gathers; the job: the used-parameter mask.
        assert set(counted["shard"]) == {"all_gather", "reduce_scatter"}
        assert axis("shard") == est.comm_shard > 0
        assert counted["replicate"]["all_reduce"]["bytes"] == est.comm_replicas > 0
        assert axis("tp") == est.comm_tp > 0
        assert axis("shard") + axis("replicate") + axis("tp") + axis("world") == est.comm_total
        assert est.comm_inter_node == est.comm_replicas + axis("world")  # one node: a shard pair x TP pair


def _replicas_of_tp_pairs_body() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    build, batches, _, tp_plan = _setup("toy")
    result = train_side_by_side(build, lambda m: bmt.BMTrainModelWrapper(m, mesh=mesh, tp_plan=tp_plan),
                                batches, data_parallel=(bmt.rank() // 2, 2))
    return {"losses": result["losses"], "by_group": sorted(bmt.comm_stats(by_group=True))}


def test_replicas_of_unsharded_tp_pairs_match_plain_pytorch() -> None:
    # 4 ranks as 2 replicas x shard groups of 1 x TP 2: no ZeRO gathers, gradients averaged across replicas
    results = run_distributed(_replicas_of_tp_pairs_body, 4)
    assert all(r["losses"] == results[0]["losses"] and len(r["losses"]) == 2 for r in results)
    assert all("replicate" in r["by_group"] and "tp" in r["by_group"] for r in results), results


def _bad_mesh_body(kind: str) -> tuple[str, str]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = ("replicate", "shard", "tp")
    if kind == "not adjacent":
        mesh = DeviceMesh("cpu", [[[0, 2], [1, 3]]], mesh_dim_names=names)
        return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), mesh=mesh, tp_plan=TOY_PLAN))
    if kind == "tp 1":
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=names)
        return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), mesh=mesh))
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=names)
    return raised(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(), mesh=mesh, tp_size=4))


@pytest.mark.parametrize("kind, words", [("not adjacent", "adjacent"), ("tp 1", "mesh_dim_names=('replicate', "
                                                                                 "'shard')"),
                                         ("tp_size", "differs from the mesh's 'tp' dimension")])
def test_a_bad_3d_mesh_is_a_mesh_error_on_every_rank(kind: str, words: str) -> None:
    results = run_distributed(_bad_mesh_body, 4, kind)
    assert all(r[0] == "MeshError" and words in r[1] for r in results), results


# ---- checkpoints under the mesh ------------------------------------------------------------------------------
def _ckpt_wrapped(name: str, layout: str):
    """(model, AdamW, loss_fn, batches) of test_checkpoint_tp, wrapped on the 3-D mesh or at tp2 x dp2."""
    import test_checkpoint_tp as ck

    build, plan, loss_fn, batches = ck._setup(name)
    model = bmt.BMTrainModelWrapper(build(), mesh=_mesh(), tp_plan=plan) if layout == "3d" else \
        bmt.BMTrainModelWrapper(build(), tp_size=2, tp_plan=plan)
    return model, ck._optimizer(model), loss_fn, batches


def _ckpt_save_body(name: str, tmp: str) -> list[float]:
    """Train on the 3-D mesh, save in both formats (``{tmp}/bmt/ckpt``, ``{tmp}/dcp/ckpt``) and whole, train on."""
    import test_checkpoint_tp as ck

    model, opt, loss_fn, batches = _ckpt_wrapped(name, "3d")
    losses = ck._train(model, opt, loss_fn, batches, range(ck.BEFORE))
    for fmt in ("bmt", "dcp"):
        ck._save(fmt, f"{tmp}/{fmt}/ckpt", model, opt)
    bmt.save(model, f"{tmp}/whole.safetensors")  # consolidated: one writer (TP rank 0 of the first shard rank)
    return losses + ck._train(model, opt, loss_fn, batches, range(ck.BEFORE, ck.BEFORE + ck.AFTER))


@pytest.fixture(scope="module")
def saved_on_the_mesh(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[float]]]:
    """The toy GPT's ``_ckpt_save_body`` run, once for both formats' tests: (its directory, every rank's losses)."""
    tmp = str(tmp_path_factory.mktemp("mesh3d"))
    return tmp, run_distributed(_ckpt_save_body, WORLD, "toy", tmp, timeout=600)


def _ckpt_resume_body(name: str, fmt: str, tmp: str, layout: str) -> dict:
    import test_checkpoint_tp as ck

    model, opt, loss_fn, batches = _ckpt_wrapped(name, layout)
    ck._load(fmt, f"{tmp}/ckpt", model, opt)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    again = f"{tmp}/again-{layout}"
    ck._save(fmt, again, model, opt)
    losses = ck._train(model, opt, loss_fn, batches, range(ck.BEFORE, ck.BEFORE + ck.AFTER))
    return {"params": params if bmt.rank() == 0 else None, "again": again, "losses": losses}


@pytest.mark.parametrize("fmt", ["bmt", "dcp"])
def test_a_checkpoint_saved_on_the_3d_mesh_resumes_exactly_there_and_at_tp2_dp2(
        saved_on_the_mesh: tuple[str, list[list[float]]], fmt: str) -> None:
    import test_checkpoint_tp as ck

    directory, uninterrupted = saved_on_the_mesh
    tmp = f"{directory}/{fmt}"
    assert all(r == uninterrupted[0] for r in uninterrupted)
    params, optim = ck._plain_state(fmt, f"{tmp}/ckpt")
    from safetensors.torch import load_file

    ck._assert_same_tensors(load_file(f"{directory}/whole.safetensors"), params, "bmt.save's file")
    plain_losses, _ = ck._plain_run("toy", None)
    torch.testing.assert_close(uninterrupted[0], plain_losses, rtol=ck.LOSS_RTOL, atol=0)
    for layout, world in (("3d", WORLD), ("tp2", 4)):
        results = run_distributed(_ckpt_resume_body, world, "toy", fmt, tmp, layout, timeout=600)
        ck._assert_same_tensors(results[0]["params"], params, f"{layout}: loaded parameters")
        again_params, again_optim = ck._plain_state(fmt, results[0]["again"])
        ck._assert_same_tensors(again_params, params, f"{layout}: parameters saved again")
        ck._assert_same_tensors(again_optim, optim, f"{layout}: optimizer state saved again")
        if layout == "3d":  # the saved layout: bit-equal to the run that never stopped
            assert all(r["losses"] == uninterrupted[0][ck.BEFORE:] for r in results)
        else:
            torch.testing.assert_close(results[0]["losses"], uninterrupted[0][ck.BEFORE:], rtol=ck.LOSS_RTOL, atol=0)
