"""Tensor parallelism's foundations (issue 28): the topology ``init_distributed(tp_size=)`` builds, the TP
autograd ops, TP-split parameters under ZeRO over the data-parallel group, and the TP-peer input check.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import COMM_TIMEOUT, run_distributed

import bmt_wrap as bmt
from bmt_wrap.errors import InitError, TPInputMismatchError, TPShapeError
from bmt_wrap.runtime import tp_ops


def use_tp(tp_size: int) -> None:
    """What a BMTrain script's ``bmt.init_distributed(tp_size=T)`` does, inside a persistent worker."""
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=tp_size)


# ---- topology ---------------------------------------------------------------------------------------------
def _topology_body(tp_size: int) -> dict:
    use_tp(tp_size)
    layout = bmt.parallel_layout()
    keys = ("tp_size", "tp_rank", "tp_zero_size", "tp_zero_rank", "zero_size", "zero_rank")
    out = {k: bmt.config[k] for k in keys}
    topo = bmt.config["topology"]
    out.update(tp_id=topo.tp_id, tp_idx=topo.tp_idx, tp_comm=bmt.nccl.commCount(bmt.config["tp_comm"]),
               tp_zero_comm=bmt.nccl.commRank(bmt.config["tp_zero_comm"]),
               layout=(layout.tp_size, layout.tp_rank, layout.dp_size, layout.dp_rank),
               data=(bmt.data_parallel_rank(), bmt.data_parallel_size()))
    # Who the TP peers and the dp group are, by a collective over each.
    r = torch.tensor([float(bmt.rank())])
    peers = bmt.distributed.all_gather(r, comm=bmt.config["tp_comm"]).flatten().tolist()
    column = bmt.distributed.all_gather(r, comm=bmt.config["tp_zero_comm"]).flatten().tolist()
    out.update(peers=[int(x) for x in peers], column=[int(x) for x in column])
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_topology_follows_bmtrain_layout(tp_size: int) -> None:
    world = 4
    results = run_distributed(_topology_body, world, tp_size)
    dp = world // tp_size
    for rank, got in enumerate(results):
        tp_rank, dp_rank = rank % tp_size, rank // tp_size
        assert got == {"tp_size": tp_size, "tp_rank": tp_rank, "tp_zero_size": dp, "tp_zero_rank": dp_rank,
                       "zero_size": world, "zero_rank": rank, "tp_id": tp_rank, "tp_idx": dp_rank,
                       "tp_comm": tp_size, "tp_zero_comm": dp_rank,
                       "layout": (tp_size, tp_rank, dp, dp_rank), "data": (dp_rank, dp),
                       "peers": [dp_rank * tp_size + i for i in range(tp_size)],
                       "column": [i * tp_size + tp_rank for i in range(dp)]}


def _bad_tp_size_body() -> str:
    with pytest.raises(InitError, match=r"world size 4 must be a multiple of tp_size") as info:
        use_tp(3)
    assert bmt.config["tp_size"] == 1  # unchanged
    return str(info.value)


def test_tp_size_not_dividing_the_world_raises_on_every_rank() -> None:
    messages = run_distributed(_bad_tp_size_body, 4)
    assert len(set(messages)) == 1 and "tp_size=3" in messages[0]


# ---- the TP autograd ops ----------------------------------------------------------------------------------
def _ops_body(tp_size: int) -> None:
    use_tp(tp_size)
    comm = bmt.config["tp_comm"]
    r, n = bmt.config["tp_rank"], tp_size
    g = torch.Generator().manual_seed(7)
    full = torch.randn(4, 2 * n, 3, generator=g)  # the same on every rank
    mine = full.chunk(n, dim=1)[r]
    weights = torch.randn(n, 4, 2 * n, 3, generator=g)  # a different downstream per TP rank

    # copy_to_tp: identity forward, gradient summed over the group.
    x = full.clone().requires_grad_(True)
    y = tp_ops.copy_to_tp(x, comm)
    assert torch.equal(y, full)
    (y * weights[r]).sum().backward()
    torch.testing.assert_close(x.grad, weights.sum(0))

    # reduce_from_tp: sum forward, gradient passed through.
    x = (full * (r + 1)).requires_grad_(True)
    y = tp_ops.reduce_from_tp(x, comm)
    torch.testing.assert_close(y, full * sum(range(1, n + 1)))
    (y * weights[0]).sum().backward()
    torch.testing.assert_close(x.grad, weights[0])

    # gather_from_tp along dim 1: every slice, backward keeps this rank's slice.
    x = mine.clone().requires_grad_(True)
    y = tp_ops.gather_from_tp(x, comm, dim=1)
    assert torch.equal(y, full)
    (y * weights[0]).sum().backward()
    torch.testing.assert_close(x.grad, weights[0].chunk(n, dim=1)[r])

    # scatter_to_tp: own slice forward, gradients of every rank's slice gathered in backward.
    x = full.clone().requires_grad_(True)
    y = tp_ops.scatter_to_tp(x, comm, dim=1)
    assert torch.equal(y, mine)
    (y * weights[r].chunk(n, dim=1)[r]).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([weights[i].chunk(n, dim=1)[i] for i in range(n)], dim=1))

    # gather_sum_grads: gather forward, each rank's different use summed into the owner's slice.
    x = mine.clone().requires_grad_(True)
    y = tp_ops.gather_sum_grads(x, comm, dim=1)
    assert torch.equal(y, full)
    (y * weights[r]).sum().backward()
    torch.testing.assert_close(x.grad, weights.sum(0).chunk(n, dim=1)[r])

    # reduce_scatter_to_tp along dim 0 (rows), gradients gathered back.
    x = (full * (r + 1)).requires_grad_(True)
    y = tp_ops.reduce_scatter_to_tp(x.repeat(n, 1, 1), comm, dim=0)
    torch.testing.assert_close(y, full * sum(range(1, n + 1)))
    (y * weights[r]).sum().backward()
    torch.testing.assert_close(x.grad, torch.stack([weights[i] for i in range(n)]).sum(0))

    if n > 1:
        with pytest.raises(TPShapeError, match="not divisible by the tensor-parallel size"):
            tp_ops.scatter_to_tp(torch.ones(3, 2 * n + 1), comm, dim=1)
    # Bytes are counted under the "tp" scope like every other collective.
    stats = bmt.comm_stats(by_group=True)
    if n > 1:
        assert stats["tp"]["all_gather"]["calls"] >= 3 and stats["tp"]["all_reduce"]["calls"] >= 2


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_ops_forward_and_backward(tp_size: int) -> None:
    run_distributed(_ops_body, 4, tp_size)


# ---- TP-split parameters under ZeRO over the data-parallel group -----------------------------------------
def _split_param_body() -> dict:
    use_tp(2)
    r, tp_rank = bmt.rank(), bmt.config["tp_rank"]
    # Each rank passes different values; TP-split parameters keep their dp group's first rank's slice,
    # whole parameters rank 0's.
    split = bmt.DistributedParameter(torch.full((3, 4), float(r)), tp_mode=True, tp_split_dim=0)
    whole = bmt.DistributedParameter(torch.full((5,), float(r)))
    marked = bmt.DistributedParameter(torch.full((4,), float(r)), tp_mode=True, tp_split_dim=-1)
    assert split.shape == (3, 4) and split._tp_mode and split._tp_split_dim == 0
    assert split._tp_original_shape == torch.Size([6, 4])
    assert not getattr(whole, "_tp_mode", False) and marked._tp_original_shape == torch.Size([4])
    # ZeRO shards over the dp group (2 ranks): the flat buffer is split in two, TP peers hold the same range.
    assert split.shard_group.comm.world_size == 2 and split.flat_buffer.shard.numel() == 32
    assert split.source_range() == ((0, 12) if bmt.config["tp_zero_rank"] == 0 else (0, 0))
    return {"split": split.full_tensor().tolist(), "whole": whole.full_tensor().tolist(),
            "tp_rank": tp_rank, "marked": marked.full_tensor().tolist()}


def test_tp_split_parameter_marks_and_start_values() -> None:
    results = run_distributed(_split_param_body, 4)
    for got in results:
        assert got["split"] == [[float(got["tp_rank"])] * 4] * 3  # its column's dp rank 0 = global rank tp_rank
        assert got["whole"] == [0.0] * 5 and got["marked"] == [0.0] * 4


def _grad_reduce_body() -> dict:
    """Gradients: averaged over dp for every parameter; summed over TP for unmarked whole parameters
    (each TP peer runs them on its own part of the data, BMTrain's layout), not for marked ones."""
    use_tp(2)
    r, tp_rank, dp_rank = bmt.rank(), bmt.config["tp_rank"], bmt.config["tp_zero_rank"]
    split = bmt.DistributedParameter(torch.zeros(2, 3), tp_mode=True, tp_split_dim=1)
    whole = bmt.DistributedParameter(torch.zeros(4))
    marked = bmt.DistributedParameter(torch.zeros(4), tp_mode=True, tp_split_dim=-1)
    module = bmt.DistributedModule()
    module.split, module.whole, module.marked = split, whole, marked

    def forward() -> torch.Tensor:
        return (module.split * (r + 1)).sum() + (module.whole * (r + 1)).sum() + (module.marked * (dp_rank + 1)).sum()

    module.forward = forward  # type: ignore[method-assign]
    module().backward()
    return {"split": split.grad.full_tensor().tolist(), "whole": whole.grad.full_tensor().tolist(),
            "marked": marked.grad.full_tensor().tolist(), "tp_rank": tp_rank}


def test_gradients_average_over_dp_and_sum_over_tp_for_unmarked_whole_parameters() -> None:
    results = run_distributed(_grad_reduce_body, 4)
    # ranks 0,1 are dp rank 0 (tp 0,1); ranks 2,3 dp rank 1. Factor (r + 1).
    for got in results:
        t = got["tp_rank"]
        # split: average over the dp column {t, t + 2} of (r + 1) = (t + 1 + t + 3) / 2
        assert got["split"] == [[t + 2.0] * 3] * 2
        # whole: sum over TP of the dp average = (1 + 3)/2 + (2 + 4)/2 = 5
        assert got["whole"] == [5.0] * 4
        # marked: identical on TP peers (dp_rank + 1), averaged over dp = 1.5, not summed
        assert got["marked"] == [1.5] * 4


# ---- TP peers given different batches -----------------------------------------------------------------------
def _input_check_body() -> str | None:
    use_tp(2)
    dp_rank = bmt.config["tp_zero_rank"]
    batch = torch.arange(6).view(2, 3) + 10 * dp_rank  # TP peers agree, dp groups differ: fine
    bmt.check_tp_inputs_agree([batch], "the batch")
    bad = batch + (bmt.rank() == 3)  # rank 3 (TP rank 1 of dp rank 1) differs from its peer
    try:
        bmt.check_tp_inputs_agree([bad], "the batch")
    except TPInputMismatchError as exc:
        return str(exc)
    return None


def test_tp_peers_given_different_batches_raise_on_every_rank_of_the_group() -> None:
    results = run_distributed(_input_check_body, 4)
    assert results[0] is None and results[1] is None  # their group agrees
    assert results[2] == results[3] and "differ between the ranks of one tensor-parallel group" in results[2]
    assert "TP ranks [1] differ" in results[2] and "tp_zero_size" in results[2]


# ---- whole tensors in files and state dicts, at any tensor-parallel size ---------------------------------
WHOLE = torch.arange(32.0).view(4, 8)  # a (4, 8) weight split along dim 1 and a (4,) bias split along dim 0


def _tp_module(tp_size: int) -> torch.nn.Module:
    m = bmt.DistributedModule()
    r = bmt.config["tp_rank"]
    m.weight = bmt.DistributedParameter(WHOLE.chunk(tp_size, dim=1)[r].clone(), tp_mode=True, tp_split_dim=1)
    m.bias = bmt.DistributedParameter(torch.arange(4.0).chunk(tp_size)[r].clone(), tp_mode=True, tp_split_dim=0)
    m.norm = bmt.DistributedParameter(torch.full((3,), 7.0))
    return m


def _save_body(path: str, tp_size: int) -> dict:
    use_tp(tp_size)
    m = _tp_module(tp_size)
    bmt.save(m, path)
    state = m.state_dict()
    return {k: v.tolist() for k, v in state.items()}


def _load_body(path: str, tp_size: int) -> dict:
    use_tp(tp_size)
    m = _tp_module(tp_size)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    bmt.load(m, path)
    r = bmt.config["tp_rank"]
    return {"weight": m.weight.full_tensor().tolist(), "want_weight": WHOLE.chunk(tp_size, dim=1)[r].tolist(),
            "bias": m.bias.full_tensor().tolist(), "want_bias": torch.arange(4.0).chunk(tp_size)[r].tolist(),
            "norm": m.norm.full_tensor().tolist()}


def test_save_at_tp2_holds_whole_tensors_and_loads_at_tp_1_2_4(tmp_path: object) -> None:
    from safetensors.torch import load_file

    path = str(tmp_path / "tp.safetensors")  # type: ignore[operator]
    states = run_distributed(_save_body, 4, path, 2)
    saved = load_file(path)
    assert torch.equal(saved["weight"], WHOLE) and torch.equal(saved["bias"], torch.arange(4.0))
    for state in states:  # state_dict() is whole on every rank too
        assert state == {"weight": WHOLE.tolist(), "bias": list(range(4)), "norm": [7.0] * 3}
    for tp_size in (1, 2, 4):
        for got in run_distributed(_load_body, 4, path, tp_size):
            assert got["weight"] == got["want_weight"] and got["bias"] == got["want_bias"]
            assert got["norm"] == [7.0] * 3


# ---- dimensions tensor parallelism cannot split ------------------------------------------------------------------
def _not_divisible_body() -> list[str]:
    use_tp(4)
    messages = []
    for build in (lambda: bmt.nn.ColumnParallelLinear(8, 6), lambda: bmt.nn.RowParallelLinear(6, 8),
                  lambda: bmt.nn.VPEmbedding(10, 8)):
        with pytest.raises(TPShapeError, match="not divisible by the tensor-parallel size 4") as info:
            build()
        messages.append(str(info.value))
    return messages


def test_dimensions_not_divisible_by_tp_size_raise_on_every_rank() -> None:
    results = run_distributed(_not_divisible_body, 4)
    assert all(r == results[0] for r in results)
    assert [m.split("=")[0] for m in results[0]] == ["ColumnParallelLinear out_features",
                                                   "RowParallelLinear in_features", "VPEmbedding vocab_size"]


def _init_body(tp_size: int) -> list:
    use_tp(tp_size)
    torch.manual_seed(3)
    layer = bmt.nn.RowParallelLinear(8, 4)
    bmt.init_parameters(layer)
    return layer.state_dict()["weight"].tolist()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_init_parameters_draws_tp_weights_whole_as_the_unsplit_layer(tp_size: int) -> None:
    torch.manual_seed(3)
    whole = torch.empty(4, 8)
    torch.nn.init.xavier_normal_(whole)  # construction
    torch.nn.init.xavier_normal_(whole)  # init_parameters draws again, on the whole tensor
    for got in run_distributed(_init_body, 4, tp_size):
        assert torch.equal(torch.tensor(got), whole)
