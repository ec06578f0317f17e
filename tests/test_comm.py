"""The communicator: every collective on real gloo groups of 1, 2 and 4 ranks, sync and async, and the
point-to-point transfers pipelines use."""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_harness import DistributedTestError, run_distributed
from hypothesis import given
from hypothesis import strategies as st

import bmt_wrap as bmt
from bmt_wrap.distributed import comm
from bmt_wrap.errors import CollectiveMismatchError, CommError, CommTimeoutError
from bmt_wrap.runtime.comm import CountingCommunicator, FingerprintCommunicator, SingleProcessCommunicator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WORLD_SIZES = [1, 2, 4]


def _values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers are exact in every dtype we test, so sums compare exactly.
    return ((torch.arange(numel) * 7 + rank * 3) % 17).to(dtype)


def _collectives_body(numel: int, dtype_name: str, async_op: bool) -> dict:
    dtype = getattr(torch, dtype_name)
    c = comm()
    r, n = c.rank, c.world_size
    shard = _values(r, numel, dtype)
    out = torch.full((numel * n,), -1, dtype=dtype)
    h = c.all_gather_into(out, shard, async_op=async_op)
    if async_op:
        h.wait()
    expected = torch.cat([_values(k, numel, dtype) for k in range(n)])
    assert torch.equal(out, expected), "all_gather_into"

    full = torch.cat([_values(r + k, numel, dtype) for k in range(n)])
    piece = torch.empty(numel, dtype=dtype)
    h = c.reduce_scatter_into(piece, full, "sum", async_op=async_op)
    if async_op:
        h.wait()
    ref = sum(torch.cat([_values(k + j, numel, torch.float64) for j in range(n)]) for k in range(n))
    assert torch.equal(piece.double(), ref[r * numel:(r + 1) * numel]), "reduce_scatter_into sum"

    piece_avg = torch.empty(numel, dtype=dtype)
    c.reduce_scatter_into(piece_avg, full, "avg")
    torch.testing.assert_close(piece_avg.double(), ref[r * numel:(r + 1) * numel] / n,
                               rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)

    t = _values(r, numel, dtype)
    h = c.all_reduce(t, "sum", async_op=async_op)
    if async_op:
        h.wait()
    assert torch.equal(t.double(), sum(_values(k, numel, torch.float64) for k in range(n))), "all_reduce"
    t = torch.full((numel,), float(r), dtype=dtype)
    c.all_reduce(t, "max")
    assert torch.all(t == n - 1)
    t = torch.full((numel,), float(r), dtype=dtype)
    c.all_reduce(t, "min")
    assert torch.all(t == 0)

    b = _values(r, numel, dtype)
    h = c.broadcast(b, src=n - 1, async_op=async_op)
    if async_op:
        h.wait()
    assert torch.equal(b, _values(n - 1, numel, dtype)), "broadcast"
    c.barrier()
    return c.snapshot()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_collectives(world_size: int, dtype: torch.dtype, async_op: bool) -> None:
    for numel in (1, 33):
        stats = run_distributed(_collectives_body, world_size, numel, str(dtype).split(".")[1], async_op)
        assert all(s == stats[0] for s in stats), "every rank counts the same"


@pytest.mark.parametrize("world_size", [2, 4])
def test_large_and_odd_sizes(world_size: int) -> None:
    # Sizes around a few MiB and odd element counts exercise the transfer paths beyond toy sizes.
    for numel in (3, 1_048_573, 4 * 1024 * 1024 + 1):
        run_distributed(_collectives_body, world_size, numel, "float32", True)


def _many_in_flight_body() -> None:
    c = comm()
    r, n = c.rank, c.world_size
    outs, handles = [], []
    for i in range(6):
        shard = torch.full((1000 + i,), float(r * 10 + i))
        out = torch.empty((1000 + i) * n)
        handles.append(c.all_gather_into(out, shard, async_op=True))
        outs.append(out)
    for i, (h, out) in enumerate(zip(handles, outs, strict=True)):
        h.wait()
        for k in range(n):
            assert torch.all(out[k * (1000 + i):(k + 1) * (1000 + i)] == k * 10 + i)


@pytest.mark.parametrize("world_size", [2, 4])
def test_many_async_ops_in_flight_complete_in_order(world_size: int) -> None:
    run_distributed(_many_in_flight_body, world_size)


def _finished_op_keeps_body() -> list[str]:
    c = comm()
    full, out = torch.ones(4096 * c.world_size), torch.empty(4096)
    released = {"broadcast": threading.Event(), "reduce_scatter": threading.Event()}
    # Callbacks fire when the last reference goes, on whichever thread drops it: waiting on them waits for
    # the release itself. gloo's own worker drops its op a moment after waking the waiter, so a look right
    # after wait() races it; the bug this guards against kept the last op's tensors until the next op, so
    # they never go here, and the deadline is only a bound on the wait.
    refs = [weakref.ref(full, lambda _: released["broadcast"].set()),
            weakref.ref(out, lambda _: released["reduce_scatter"].set())]
    c.broadcast(full, 0)
    c.reduce_scatter_into(out, full)
    del full, out
    kept = [name for name, event in released.items() if not event.wait(10.0)]
    del refs
    return kept


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_finished_op_keeps_none_of_its_tensors(world_size: int) -> None:
    """The worker thread let the last op's closure, and so its buffers, live until the next op arrived: the
    full flat of the last group a wrap broadcast, a gradient at a step's end."""
    for kept in run_distributed(_finished_op_keeps_body, world_size):
        assert kept == [], f"tensors of finished ops never released: {kept}"


def _counting_body() -> dict:
    c = comm()
    n = c.world_size
    c.reset()
    shard = torch.zeros(100)
    c.all_gather_into(torch.zeros(100 * n), shard)
    c.reduce_scatter_into(torch.zeros(100), torch.zeros(100 * n))
    c.all_reduce(torch.zeros(100, dtype=torch.bfloat16))
    c.broadcast(torch.zeros(10))
    return bmt.comm_stats()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_counting_reports_algorithmic_bytes(world_size: int) -> None:
    stats = run_distributed(_counting_body, world_size)[0]
    n = world_size
    assert stats["all_gather"] == {"calls": 1, "bytes": 400 * (n - 1)}
    assert stats["reduce_scatter"] == {"calls": 1, "bytes": 400 * (n - 1)}
    assert stats["all_reduce"] == {"calls": 1, "bytes": round(2 * 200 * (n - 1) / n)}
    assert stats["broadcast"] == {"calls": 1, "bytes": 40 if n > 1 else 0}


def _skip_collective_body(skipper: int) -> str:
    c = comm()
    c.timeout = timedelta(seconds=3)
    if c.rank == skipper:
        return "skipped"
    try:
        c.all_reduce(torch.ones(4))
    except CommTimeoutError as exc:
        msg = str(exc)
        assert "all_reduce" in msg and "unusable" in msg and "3s" in msg, msg
        # Fatal: the next op refuses at once instead of hanging.
        with pytest.raises(CommTimeoutError, match="unusable"):
            c.barrier()
        return "timed out"
    return "completed"


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_skipping_a_collective_times_out_with_a_clear_error(world_size: int) -> None:
    results = run_distributed(_skip_collective_body, world_size, world_size - 1, timeout=60)
    assert results[-1] == "skipped"
    assert all(r == "timed out" for r in results[:-1]), results


def _mismatch_body() -> str:
    c = FingerprintCommunicator(comm().inner)
    c.timeout = timedelta(seconds=20)
    label = "layers.0" if c.rank == 0 else "layers.1"
    try:
        c.all_gather_into(torch.zeros(8 * c.world_size), torch.zeros(8), label=label)
    except CollectiveMismatchError as exc:
        assert "layers.0" in str(exc) and "layers.1" in str(exc), str(exc)
        return "mismatch"
    return "no error"


def test_fingerprint_names_both_sides_of_a_mismatch() -> None:
    assert run_distributed(_mismatch_body, 2) == ["mismatch", "mismatch"]


def _bad_args_body() -> None:
    c = comm()
    with pytest.raises(CommError, match="contiguous 1-D"):
        c.all_reduce(torch.zeros(2, 2))
    with pytest.raises(CommError, match="world_size"):
        c.all_gather_into(torch.zeros(3), torch.zeros(2))
    with pytest.raises(CommError, match="unsupported reduce op"):
        c.reduce_scatter_into(torch.zeros(1), torch.zeros(c.world_size), op="max")


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_arguments_raise_before_any_communication(world_size: int) -> None:
    run_distributed(_bad_args_body, world_size)


def test_single_process_communicator_copies() -> None:
    c = CountingCommunicator(SingleProcessCommunicator())
    shard = torch.arange(5.0)
    out = torch.empty(5)
    c.all_gather_into(out, shard)
    assert torch.equal(out, shard)
    piece = torch.empty(5)
    c.reduce_scatter_into(piece, shard, "avg")
    assert torch.equal(piece, shard)
    assert c.snapshot()["all_gather"] == {"calls": 1, "bytes": 0}


@given(numel=st.integers(1, 300), world_size=st.sampled_from([2, 4]))
def test_property_gather_of_scatter_is_identity(numel: int, world_size: int) -> None:
    run_distributed(_roundtrip_body, world_size, numel)


def _roundtrip_body(numel: int) -> None:
    c = comm()
    torch.manual_seed(numel)
    full = torch.randn(numel * c.world_size)  # same on every rank (same seed)
    piece = full[c.rank * numel:(c.rank + 1) * numel].clone()
    out = torch.empty_like(full)
    c.all_gather_into(out, piece)
    assert torch.equal(out, full)
    red = torch.empty(numel)
    c.reduce_scatter_into(red, full, "avg")
    torch.testing.assert_close(red, piece)


def test_harness_propagates_rank_tracebacks() -> None:
    with pytest.raises(DistributedTestError, match="rank 1"):
        run_distributed(_fail_on_rank_one, 2)


def _fail_on_rank_one() -> None:
    if bmt.rank() == 1:
        raise ValueError("boom on rank 1")


# ---- point to point ------------------------------------------------------------------------------------------
def _send_recv_body() -> dict:
    c = comm()
    r, n = c.rank, c.world_size
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = {}
    # A ring of async transfers with two tags each. Each pair posts them in the same order on both ends
    # (even ranks send first, odd ranks receive first), as the interface asks.
    got = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
    sends = [lambda t=t: c.send(torch.full((3,), float(10 * r + t), dtype=torch.float64), nxt, tag=t,
                                async_op=True, label="ring") for t in range(2)]
    recvs = [lambda t=t: c.recv(got[t], prv, tag=t, async_op=True, label="ring") for t in range(2)]
    handles = [post() for post in (sends + recvs if r % 2 == 0 else recvs + sends)]
    for h in handles:
        h.wait()
    out["ring"] = [g.tolist() for g in got]
    # Within a sub-group, peers are its own ranks.
    if n == 4:
        pair = tuple(range(r - r % 2, r - r % 2 + 2))
        sub = c.subgroup_counted(pair, _pair_group(pair), "pp")
        x = torch.arange(4, dtype=torch.float32) + r
        if sub.rank == 0:
            sub.send(x, 1, tag=7, label="pair")
        else:
            sub.recv(x, 0, tag=7, label="pair")
        out["pair"] = x.tolist()
        out["scoped"] = c.by_scope()["pp"]["send" if sub.rank == 0 else "recv"]
    # Bad peers and tags are refused before any communication.
    with pytest.raises(CommError, match="not another rank"):
        c.send(torch.zeros(1), r)
    with pytest.raises(CommError, match="tag"):
        c.recv(torch.zeros(1), prv, tag=1 << 16)
    return out


_PAIR_GROUPS: dict = {}


def _pair_group(pair: tuple[int, int]):  # every rank creates both pairs' groups, in order
    if not _PAIR_GROUPS:
        _PAIR_GROUPS.update({p: dist.new_group(list(p)) for p in [(0, 1), (2, 3)]})
    return _PAIR_GROUPS[pair]


@pytest.mark.parametrize("world_size", [2, 4])
def test_send_and_recv_match_by_pair_and_tag(world_size: int) -> None:
    results = run_distributed(_send_recv_body, world_size)
    for r, got in enumerate(results):
        prv = (r - 1) % world_size
        assert got["ring"] == [[10.0 * prv + t] * 3 for t in range(2)], got
        if world_size == 4:
            assert got["pair"] == [float(r - r % 2 + i) for i in range(4)]  # the pair's first rank's values
            assert got["scoped"] == {"calls": 1, "bytes": 16}


def _p2p_mismatch_body() -> str:
    c = comm()
    c.timeout = timedelta(seconds=20)
    try:
        if c.rank == 0:
            c.send(torch.zeros(4), 1, tag=3, label="stage 0 output")
        else:
            c.recv(torch.zeros(4), 0, tag=4, label="stage 0 output")  # another micro-batch's tag
    except CollectiveMismatchError as exc:
        assert "tag 3" in str(exc) and "tag 4" in str(exc), str(exc)
        return "mismatch"
    return "no error"


def test_a_send_and_recv_that_disagree_name_both_sides() -> None:
    assert run_distributed(_p2p_mismatch_body, 2) == ["mismatch", "mismatch"]


def test_single_process_sends_to_itself_through_a_mailbox() -> None:
    c = CountingCommunicator(SingleProcessCommunicator())
    c.send(torch.arange(3.0), 0, tag=2)
    c.send(torch.arange(3.0) + 1, 0, tag=2)
    got = torch.empty(3)
    c.recv(got, 0, tag=2)
    assert got.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(CommError, match="takes 2"):
        c.recv(torch.empty(2), 0, tag=2)
    assert c.snapshot()["send"] == {"calls": 2, "bytes": 24}


# ---- all-to-all (expert parallelism's dispatch and combine) --------------------------------------------------
def _a2a_piece(src: int, dst: int) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: (src + dst) % 3 elements (none for some pairs), telling both."""
    return torch.arange((src + dst) % 3, dtype=torch.float64) + 100 * src + 10 * dst


def _all_to_all_body() -> dict:
    c = comm()
    r, n = c.rank, c.world_size
    c.reset()
    inp = torch.cat([_a2a_piece(r, p) for p in range(n)])
    in_splits = [(r + p) % 3 for p in range(n)]
    out = torch.full((sum(in_splits),), -1.0, dtype=torch.float64)  # (p + r) % 3 from each p: the same sizes
    c.all_to_all(out, inp, in_splits, in_splits, label="dispatch")
    again = torch.empty_like(out)
    c.all_to_all(again, inp, in_splits, in_splits, async_op=True, label="dispatch").wait()
    with pytest.raises(CommError, match="sum"):
        c.all_to_all(out[:-1] if out.numel() else torch.empty(1, dtype=torch.float64), inp, in_splits, in_splits)
    with pytest.raises(CommError, match="non-negative sizes"):
        c.all_to_all(out, inp, in_splits[:-1], in_splits)
    return {"out": out.tolist(), "again": again.tolist(), "counted": c.snapshot()["all_to_all"]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_moves_uneven_pieces_and_counts_what_leaves(world_size: int) -> None:
    for r, got in enumerate(run_distributed(_all_to_all_body, world_size)):
        expected = torch.cat([_a2a_piece(p, r) for p in range(world_size)]).tolist()
        assert got["out"] == expected and got["again"] == expected
        sent = sum(_a2a_piece(r, p).numel() for p in range(world_size) if p != r) * 8
        assert got["counted"] == {"calls": 2, "bytes": 2 * sent}


def _all_to_all_mismatch_body() -> str:
    c = comm()
    c.timeout = timedelta(seconds=20)
    splits = [1] * c.world_size
    try:  # rank 1 combines while rank 0 still dispatches: same sizes, different ops
        c.all_to_all(torch.zeros(2), torch.zeros(2), splits, splits, label="dispatch" if c.rank == 0 else "combine")
    except CollectiveMismatchError as exc:
        assert "'dispatch" in str(exc) and "'combine" in str(exc), str(exc)
        return "mismatch"
    return "no error"


def test_an_all_to_all_that_differs_names_both_sides() -> None:
    assert run_distributed(_all_to_all_mismatch_body, 2) == ["mismatch", "mismatch"]


def test_single_process_all_to_all_is_a_copy() -> None:
    c = CountingCommunicator(SingleProcessCommunicator())
    out = torch.empty(3)
    c.all_to_all(out, torch.arange(3.0), [3], [3])
    assert out.tolist() == [0.0, 1.0, 2.0] and c.snapshot()["all_to_all"] == {"calls": 1, "bytes": 0}
