"""The one description of the rank layout (base/mesh.py): where each rank sits, its groups, its data slice."""

from __future__ import annotations

import pytest

from bmt_wrap.base.mesh import MeshLayout
from bmt_wrap.errors import MeshError


@pytest.mark.parametrize("pp, replicate, tp", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (4, 1, 1)])
def test_default_order_is_bmtrains_and_megatrons(pp: int, replicate: int, tp: int) -> None:
    world = 16
    mesh = MeshLayout.of(world, pp=pp, replicate=replicate, tp=tp)
    shard = world // (pp * replicate * tp)
    for rank in range(world):
        c = mesh.coords(rank)
        assert rank == ((c["pp"] * replicate + c["replicate"]) * shard + c["shard"]) * tp + c["tp"]
        assert mesh.rank_at(c) == rank
        assert c["tp"] == rank % tp  # BMTrain's tp_rank
        assert c["pp"] == rank // (world // pp)  # BMTrain's stage_id
        assert mesh.group(rank, ("tp",)) == tuple(rank - rank % tp + i for i in range(tp))
        stage = mesh.group(rank, ("replicate", "shard", "tp"))
        assert stage == tuple(range(c["pp"] * world // pp, (c["pp"] + 1) * world // pp))
        # BMTrain's pipe group: the ranks at this rank's place in every stage
        assert mesh.group(rank, ("pp",)) == tuple(rank % (world // pp) + s * (world // pp) for s in range(pp))
        # TP peers and the stages of one pipeline take the same slice of the data; nobody else does
        assert mesh.data_parallel_rank(rank) == c["replicate"] * shard + c["shard"]
    assert mesh.data_parallel_size == replicate * shard
    slices = {}
    for rank in range(world):
        slices.setdefault(mesh.data_parallel_rank(rank), set()).add(rank)
    assert all(len(ranks) == pp * tp for ranks in slices.values()) and len(slices) == replicate * shard
    for axes in [("tp",), ("shard",), ("pp",), ("shard", "tp"), ("replicate", "shard", "tp")]:
        groups = mesh.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the job


def test_an_hsdp_grid_keeps_its_order_and_the_default_spells_one_way() -> None:
    mesh = MeshLayout(replicate=2, shard=2, grid=(0, 2, 1, 3))  # shard groups are the mesh's rows: (0, 2), (1, 3)
    assert mesh.group(0, ("shard",)) == (0, 2) and mesh.group(1, ("shard",)) == (1, 3)
    assert mesh.group(0, ("replicate",)) == (0, 1)
    assert [mesh.data_parallel_rank(r) for r in range(4)] == [0, 2, 1, 3]
    assert MeshLayout(replicate=2, shard=2, grid=(0, 1, 2, 3)) == MeshLayout(replicate=2, shard=2)
    assert MeshLayout.of(8, pp=2, tp=2).describe() == "pp 2 x shard 2 x tp 2"


def test_bad_layouts_are_mesh_errors() -> None:
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        MeshLayout.of(6, pp=4)
    with pytest.raises(MeshError, match="every rank of 4 once"):
        MeshLayout(shard=4, grid=(0, 1, 1, 3))
    with pytest.raises(MeshError, match="positive int"):
        MeshLayout(pp=0)


@pytest.mark.parametrize("pp, replicate, tp, ep", [(1, 1, 1, 2), (1, 1, 1, 4), (1, 2, 1, 2), (2, 1, 2, 2),
                                                   (1, 1, 2, 4)])
def test_expert_parallel_ranks_are_the_fastest_part_of_the_shard_axis(pp: int, replicate: int, tp: int,
                                                                      ep: int) -> None:
    world = 16
    mesh = MeshLayout.of(world, pp=pp, replicate=replicate, tp=tp, ep=ep)
    owners = mesh.shard // ep
    for rank in range(world):
        c = mesh.coords(rank)
        assert mesh.ep_rank(rank) == c["shard"] % ep
        group = mesh.ep_group(rank)
        # ep consecutive shard ranks of this rank's stage, replica and TP rank, in EP-rank order
        assert [mesh.ep_rank(r) for r in group] == list(range(ep)) and rank in group
        assert {mesh.coords(r)["shard"] // ep for r in group} == {c["shard"] // ep}
        assert all({k: v for k, v in mesh.coords(r).items() if k != "shard"} ==
                   {k: v for k, v in c.items() if k != "shard"} for r in group)
        # the ranks owning the same experts within this replica and stage: one per group of ep shard ranks
        # and TP rank (TP peers hold the same tokens and run the same experts on them)
        same = mesh.expert_shard_group(rank)
        assert len(same) == owners * tp and rank in same and {mesh.ep_rank(r) for r in same} == {c["shard"] % ep}
        assert {(mesh.coords(r)["replicate"], mesh.coords(r)["pp"]) for r in same} == {(c["replicate"], c["pp"])}
        assert set(mesh.group(rank, ("tp",))) <= set(same)
    for group_of in (mesh.ep_group, mesh.expert_shard_group):
        groups = mesh.every(group_of)
        assert sorted(r for g in groups for r in g) == list(range(world))
    assert f"shard {mesh.shard} (ep {ep})" in mesh.describe()


def test_ep_must_divide_the_shard_axis() -> None:
    with pytest.raises(MeshError, match="ep 3 must be a positive int dividing the shard size 4"):
        MeshLayout.of(8, tp=2, ep=3)
    assert MeshLayout.of(4, ep=2) != MeshLayout.of(4)  # an EP layout is another layout (its own groups)


def test_cp_sits_between_shard_and_tp_and_its_ranks_take_the_same_data() -> None:
    mesh = MeshLayout.of(16, pp=2, cp=2, tp=2)  # shard 2
    for rank in range(16):
        c = mesh.coords(rank)
        assert rank == (((c["pp"] * 1 + c["replicate"]) * 2 + c["shard"]) * 2 + c["cp"]) * 2 + c["tp"]
        assert mesh.group(rank, ("cp",)) == tuple(rank - rank % 4 + rank % 2 + 2 * i for i in range(2))
        assert mesh.data_parallel_rank(rank) == c["shard"]
    assert mesh.data_parallel_size == 2
    assert mesh.describe() == "pp 2 x shard 2 x cp 2 x tp 2"
    # without cp the formula is the one before it
    assert MeshLayout.of(8, tp=2).coords(5) == {"pp": 0, "replicate": 0, "shard": 2, "cp": 0, "tp": 1}
