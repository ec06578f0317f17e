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
