"""The communicator: every collective on real gloo groups of 1, 2 and 4 ranks, sync and async."""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta

import pytest
import torch
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
