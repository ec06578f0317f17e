"""HSDP estimates (``passes.estimate_mesh``) and ``bmt-wrap plan --shard-size``, in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from toy import ToyGPT

from bmt_wrap.cli import main
from bmt_wrap.errors import PlanError
from bmt_wrap.passes import build_plan, discover_blocks, estimate, estimate_mesh
from bmt_wrap.plan import WrapPlan

MODELS = str(Path(__file__).with_name("models.py"))


def _plan(world_size: int) -> WrapPlan:
    model = ToyGPT()
    return build_plan(model, discover_blocks(model), world_size=world_size)


def test_hsdp_memory_and_sharded_traffic_are_zero3_over_the_shard_group() -> None:
    plan = _plan(8)
    hsdp, zero3_over_8 = estimate_mesh(plan, 64, 8, 8), estimate(plan, 8)
    assert (hsdp.world_size, hsdp.shard_size) == (64, 8)
    for field in ("params", "grads", "optimizer", "gathered", "grads_in_flight", "comm_all_gather",
                  "comm_reduce_scatter"):
        assert getattr(hsdp, field) == getattr(zero3_over_8, field), field
    grad_shards = sum(b.shard_numel(8) * 4 for g in plan.groups for b in g.buffers if b.requires_grad)
    assert hsdp.comm_replicas == 2 * grad_shards * 7 // 8
    # Gathers and reduce-scatters stay in the node; the replicas' average and the used mask cross nodes.
    assert hsdp.comm_intra_node == hsdp.comm_all_gather + hsdp.comm_reduce_scatter
    assert hsdp.comm_inter_node == hsdp.comm_all_reduce > hsdp.comm_replicas
    assert hsdp.comm_intra_node + hsdp.comm_inter_node == hsdp.comm_total


def test_zero3_over_the_job_is_a_mesh_of_one_replica_whose_traffic_crosses_nodes() -> None:
    plan = _plan(64)
    flat, split = estimate(plan, 64), estimate_mesh(plan, 64, 64, 8)
    assert split.comm_replicas == 0 and split.comm_total == flat.comm_total and split.total == flat.total
    assert (split.comm_intra_node, split.comm_inter_node) == (0, flat.comm_total)
    one_node = estimate_mesh(plan, 8, 8, 8)
    assert (one_node.comm_intra_node, one_node.comm_inter_node) == (one_node.comm_total, 0)


@pytest.mark.parametrize("world,shard,nodes", [(64, 7, 8), (64, 0, 8), (64, 8, 0)])
def test_bad_mesh_sizes_raise_plan_error(world: int, shard: int, nodes: int) -> None:
    with pytest.raises(PlanError, match="must"):
        estimate_mesh(_plan(8), world, shard, nodes)


def _row(out: str, label: str) -> list[str]:
    """The cells after ``label`` on the plan table's row that starts with it."""
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return line[len(line) - len(line.lstrip()) + len(label):].split()


def test_cli_shard_size_adds_an_hsdp_column_and_splits_traffic_by_node(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", f"{MODELS}:llama", "--world-size", "16", "--shard-size", "4", "--dtype", "bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.strip().startswith("per rank"))
    assert "N=16 ZeRO-3" in header and "N=16 HSDP 4x4" in header

    assert _row(out, "of which inter-node")[:2] == _row(out, "= communicated / step")[:2], \
        "ZeRO-3: every byte crosses nodes"
    assert _row(out, "of which intra-node")[:2] == ["0", "B"], "ZeRO-3 over every rank: nothing stays in a node"
    assert _row(out, "of which across replicas")[:2] == ["0", "B"]


def test_cli_shard_size_must_divide_the_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{MODELS}:llama", "--world-size", "16", "12", "--shard-size", "8"]) == 2
    assert "--shard-size 8 must divide every --world-size" in capsys.readouterr().err


def test_a_3d_mesh_splits_traffic_by_axis_tp_inside_the_node() -> None:
    # HSDP 2 replicas x shards of 2 x TP 2 (8 ranks, a node = one shard group and its TP peers)
    import models
    from test_tp_plan import TOY_PLAN

    from bmt_wrap import passes

    model = models.ToyGPT()
    discovery = discover_blocks(model)
    tp = passes.plan_tensor_parallel(model, 2, discovery, TOY_PLAN)
    plan = build_plan(model, discovery, world_size=2, tensor_parallel=tp)
    mesh, zero = estimate_mesh(plan, 8, 2, 4, tokens=16), estimate(plan, 2)
    alone = passes.estimate_tp(plan, 2, tokens=16)
    assert (mesh.world_size, mesh.shard_size, mesh.tp_size) == (8, 2, 2)
    assert mesh.comm_shard == zero.comm_all_gather + zero.comm_reduce_scatter > 0
    assert mesh.comm_tp == alone.comm_tp > 0
    # whole parameters' buffers are sharded over shard x tp (4 ranks), the split ones over the shard pair
    grad_shards = sum(b.shard_numel(4 if b.over_tp else 2) * 4 for g in plan.groups for b in g.buffers
                      if b.requires_grad)
    assert any(b.over_tp for g in plan.groups for b in g.buffers)
    assert mesh.comm_replicas == 2 * grad_shards // 2
    mask = mesh.comm_total - mesh.comm_shard - mesh.comm_tp - mesh.comm_replicas
    assert 0 < mask < 1000  # one byte per trainable parameter tensor, over the job
    assert mesh.comm_inter_node == mesh.comm_replicas + mask
    assert mesh.comm_intra_node == mesh.comm_shard + mesh.comm_tp
    assert mesh.params == zero.params and mesh.total == alone.total
    with pytest.raises(PlanError, match="tp size 2 must divide"):
        estimate_mesh(plan, 8, 3, 4)


def test_cli_tp_size_with_shard_size_adds_the_3d_column(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", f"{MODELS}:llama", "--world-size", "16", "--tp-size", "2", "--shard-size", "4",
                 "--input", "input_ids=int64[2,8]"])
    out = capsys.readouterr().out
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.strip().startswith("per rank"))
    assert "N=16 TP 2 x DP 8" in header and "N=16 HSDP 2x4 x TP 2" in header

    for label in ("of which across replicas", "of which in a shard group", "of which TP activations",
                  "of which intra-node", "of which inter-node"):
        assert len(_row(out, label)) == 4, label  # a value and its unit in each column
    replicas = _row(out, "of which across replicas")
    assert replicas[:2] == ["0", "B"] and replicas[2] != "0"
    assert _row(out, "of which TP activations")[:2] == _row(out, "of which TP activations")[2:]
    assert main(["plan", f"{MODELS}:llama", "--world-size", "12", "--tp-size", "2", "--shard-size", "4"]) == 2
    assert "--shard-size 4 x --tp-size 2 must divide every --world-size" in capsys.readouterr().err
