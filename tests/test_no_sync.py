"""``model.no_sync()``: micro-batches accumulate on each rank with no reduce-scatter, and the first backward
outside reduces everything, so the step equals plain PyTorch accumulating the same micro-batches."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from dist_harness import raised, run_distributed
from parity import LOSS_RTOL, compare_grads, compare_params, lm_batches
from test_engine_memory_comm import _live_bytes
from test_explicit_api import BmtGPT, PlainGPT
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.distributed import get_state
from bmt_wrap.runtime.process_engine import get_engine

WORLD_SIZES = [1, 2, 4]
MICRO = 4
CASES = {
    "checkpointed": {},
    "not-checkpointed": {"checkpoint": False},
    "zero2": {"zero_level": 2, "checkpoint": False},
}


def _build(kind: str, plan_kwargs: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference, wrapped model) with equal weights. "plain": one-process fp32 ToyGPT beside the engine's
    plan; "mixed": bf16 mixed precision, against the same wrapped model reducing every micro-batch (plain
    fp32 cannot match bf16 compute); "explicit": BMTrain's API (DistributedModule, TransformerBlockList)."""
    torch.manual_seed(0)
    if kind == "explicit":
        ref = PlainGPT()
        torch.manual_seed(0)
        model = BmtGPT(**plan_kwargs)
        model.load_state_dict(ref.state_dict())
        return ref, model
    plain = ToyGPT(layerdrop=plan_kwargs.pop("layerdrop", 0.0))
    if kind == "mixed":
        policy = bmt.MixedPrecision(param_dtype=torch.bfloat16)
        return (bmt.BMTrainModelWrapper(copy.deepcopy(plain), mixed_precision=policy, **plan_kwargs),
                bmt.BMTrainModelWrapper(copy.deepcopy(plain), mixed_precision=policy, **plan_kwargs))
    blocks = [f"layers.{i}" for i in range(3)]
    return plain, apply_plan(copy.deepcopy(plain), manual_plan(plain, blocks, **plan_kwargs))


def _reduce_scatters() -> tuple[int, int]:
    """(calls, bytes) of reduce-scatter since the last reset (bytes are 0 at world size 1: nothing moves)."""
    entry = bmt.comm_stats().get("reduce_scatter", {"calls": 0, "bytes": 0})
    return entry["calls"], entry["bytes"]


def _micro_batches(batch: tuple[torch.Tensor, ...], rank: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's slice of ``batch``, in ``MICRO`` micro-batches."""
    return list(zip(*(t.chunk(n)[rank].chunk(MICRO) for t in batch), strict=True))


def _global_micro_batches(batch: tuple[torch.Tensor, ...], n: int) -> list[tuple[torch.Tensor, ...]]:
    """Micro-batch k of every rank, together: what plain PyTorch accumulates to match."""
    per_rank = [_micro_batches(batch, r, n) for r in range(n)]
    return [tuple(torch.cat([per_rank[r][k][j] for r in range(n)]) for j in range(len(batch)))
            for k in range(MICRO)]


def _accumulate(model: torch.nn.Module, micro: list[tuple[torch.Tensor, ...]], sync_every: bool,
                window_bytes: list[int], seed: int, between: Callable[[int], None] | None = None) -> float:
    """Backward of each micro-batch's loss / MICRO; all but the last under no_sync unless ``sync_every``.
    ``between(k)`` runs after micro-batch k's backward (a zero_grad, say). Appends each micro-batch's
    reduce-scatter (calls, bytes) to ``window_bytes``."""
    total = 0.0
    for k, (x, y) in enumerate(micro):
        last = k == len(micro) - 1
        bmt.reset_comm_stats()
        torch.manual_seed(seed + k)  # layer drop draws alike in every model and on every rank
        with contextlib.nullcontext() if last or sync_every else model.no_sync():
            loss = model(x, y)
            (loss / MICRO).backward()
        window_bytes.append(_reduce_scatters())
        if between is not None:
            between(k)
        total += float(loss.detach()) / MICRO
    return total


def _parity_body(kind: str, plan_kwargs: dict, steps: int = 2, zero_grad_after: int | None = None) -> dict:
    """Train ``steps`` steps of MICRO micro-batches, all but the last under no_sync, against ``_build``'s
    reference accumulating the same micro-batches. ``zero_grad_after``: both zero their gradients after that
    micro-batch, inside the window."""
    rank, n = bmt.rank(), bmt.world_size()
    ref, model = _build(kind, dict(plan_kwargs))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def zero(optimizer: torch.optim.Optimizer) -> Callable[[int], None]:
        return lambda k: optimizer.zero_grad() if k == zero_grad_after else None

    window_bytes: list[int] = []
    losses, ref_losses = [], []
    for step, batch in enumerate(lm_batches(steps, 16)):
        seed = 1000 * (step + 1)
        if kind == "mixed":
            ref_loss = float(bmt.sum_loss(torch.tensor(
                _accumulate(ref, _micro_batches(batch, rank, n), True, [], seed, zero(ref_opt)))))
        else:
            ref_loss = _accumulate(ref, _global_micro_batches(batch, n), True, [], seed, zero(ref_opt))
        loss = _accumulate(model, _micro_batches(batch, rank, n), False, window_bytes, seed, zero(opt))
        losses.append(float(bmt.sum_loss(torch.tensor(loss))))
        ref_losses.append(ref_loss)
        compare_grads(ref, model, f"step {step}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    compare_params(ref, model, "sgd", "after training")
    return {"window_bytes": window_bytes, "losses": losses}


def _check(results: list[dict], steps: int = 2) -> None:
    """No reduce-scatter inside the window; the synchronising micro-batch reduces."""
    for r in results:
        per_step = [r["window_bytes"][i:i + MICRO] for i in range(0, steps * MICRO, MICRO)]
        assert len(per_step) == steps and all(len(s) == MICRO for s in per_step), r["window_bytes"]
        for seen in per_step:
            assert seen[:-1] == [(0, 0)] * (MICRO - 1), seen
            calls, nbytes = seen[-1]
            assert calls > 0 and (nbytes > 0 or len(results) == 1), seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_no_sync_accumulation_equals_plain_pytorch(case: str, world_size: int) -> None:
    results = run_distributed(_parity_body, world_size, "plain", CASES[case])
    _check(results)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_sync_under_mixed_precision_equals_reducing_every_micro_batch(world_size: int) -> None:
    # Sums accumulate in the reduce dtype (fp32 by default), as FSDP2's do: only rounding order differs.
    _check(run_distributed(_parity_body, world_size, "mixed", {}))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("use_checkpoint", [True, False])
def test_no_sync_on_the_explicit_api(use_checkpoint: bool, world_size: int) -> None:
    _check(run_distributed(_parity_body, world_size, "explicit", {"use_checkpoint": use_checkpoint}))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_block_the_last_micro_batch_skips_is_reduced_at_its_end(world_size: int) -> None:
    # Layer drop with these seeds runs micro-batches that skip different layers; the synchronising
    # backward must still reduce what the window accumulated for a layer it never reached.
    _check(run_distributed(_parity_body, world_size, "plain", {"layerdrop": 0.5}, 3), 3)


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_grad_inside_the_window_discards_it_as_in_torch(world_size: int) -> None:
    _check(run_distributed(_parity_body, world_size, "plain", {}, zero_grad_after=1))


def _misuse_body() -> dict[str, tuple[str, str]]:
    """What each use of unreduced gradients raises, and a step after the synchronising backward."""
    get_state().comm.timeout = timedelta(seconds=20)
    _, model = _build("plain", {})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = bmt.optim.OptimManager(loss_scale=None)
    mgr.add_optimizer(opt)
    x = torch.randint(0, 64, (2, 8))
    with model.no_sync():
        model(x, x).backward()
    out = {"step": raised(opt.step), "clip": raised(lambda: model.clip_grad_norm_(1.0)),
           "manager step": raised(mgr.step), "manager clip": raised(lambda: mgr.clip_grad_norm(1.0))}
    with model.no_sync():
        model(x, x).backward()
        with torch.no_grad():
            model.wpe.grad.add_(1.0)  # in place, inside the window
        out["in place"] = raised(lambda: model(x, x).backward())
    model.zero_grad()
    with model.no_sync():
        model(x, x).backward()
        opt.zero_grad(set_to_none=False)  # zeroes in place: whether it meant to discard cannot be told
        out["zeroed in place"] = raised(lambda: model(x, x).backward())
    model.zero_grad()  # discards the window on every rank
    out["after zero_grad"] = raised(opt.step)
    with model.no_sync():
        model(x, x).backward()
    model(x, x).backward()
    out["synchronised"] = raised(opt.step)
    return out


def test_using_unreduced_gradients_raises_a_named_error() -> None:
    results = run_distributed(_misuse_body, 2)
    for r in results:
        for what in ("step", "clip", "manager step", "manager clip"):
            name, message = r[what]
            assert name == "GradSyncError", (what, r[what])
            assert "no_sync" in message and "outside" in message and "layers.2.ln1.weight" in message, message
        for what in ("in place", "zeroed in place"):
            assert r[what][0] == "GradSyncError" and "set_to_none=True" in r[what][1], r[what]
        assert r["after zero_grad"] == ("ok", ""), r["after zero_grad"]
        assert r["synchronised"] == ("ok", ""), r["synchronised"]


def _nesting_body() -> list[int]:
    """Reduce-scatter bytes of: a backward in nested windows, one in the outer window after the inner
    closed, one after a window an exception left, and one under the loss-scaling manager."""
    _, model = _build("plain", {})
    x = torch.randint(0, 64, (2, 8))
    seen = []
    with model.no_sync():
        with model.no_sync():
            bmt.reset_comm_stats()
            model(x, x).backward()
            seen.append(_reduce_scatters()[1])
        bmt.reset_comm_stats()
        model(x, x).backward()
        seen.append(_reduce_scatters()[1])
    with contextlib.suppress(ValueError), model.no_sync():
        raise ValueError("a failing micro-batch")
    bmt.reset_comm_stats()
    model(x, x).backward()
    seen.append(_reduce_scatters()[1])
    return seen


def test_nested_windows_and_an_exception_inside_one() -> None:
    for seen in run_distributed(_nesting_body, 2):
        assert seen[:2] == [0, 0] and seen[2] > 0, seen


def _loss_scale_body() -> None:
    """OptimManager's loss scale over a window equals plain accumulation (2**10 scales exactly)."""
    rank, n = bmt.rank(), bmt.world_size()
    ref, model = _build("plain", {})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mgr = bmt.optim.OptimManager(loss_scale=2 ** 10)
    mgr.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in lm_batches(2, 16):
        for x, y in _global_micro_batches(batch, n):
            (ref(x, y) / MICRO).backward()
        micro = _micro_batches(batch, rank, n)
        for k, (x, y) in enumerate(micro):
            with contextlib.nullcontext() if k == MICRO - 1 else model.no_sync():
                mgr.backward(model(x, y) / MICRO)
        ref_opt.step()
        assert mgr.step()
        ref_opt.zero_grad()
        mgr.zero_grad()
    compare_params(ref, model, "sgd", "after training")


def test_no_sync_with_the_loss_scaling_manager() -> None:
    run_distributed(_loss_scale_body, 2)


def _disagreeing_body() -> tuple[str, str]:
    get_state().comm.timeout = timedelta(seconds=20)
    _, model = _build("plain", {})
    x = torch.randint(0, 64, (2, 8))

    def step() -> None:
        with model.no_sync() if bmt.rank() == 0 else contextlib.nullcontext():
            model(x, x).backward()
        model(x, x).backward()
        bmt.synchronize()

    return raised(step)


def test_ranks_that_disagree_on_no_sync_all_raise() -> None:
    results = run_distributed(_disagreeing_body, 2, timeout=120)
    assert [name for name, _ in results] == ["CollectiveMismatchError"] * 2, results
    for _, message in results:
        assert "no_sync" in message, message


def _window_memory_body() -> tuple[int, int, int]:
    """(bytes the window's accumulators hold, the plan's estimate of them, how much more every live
    storage holds inside a window than after synchronised steps: an independent gc count) after two
    micro-batches under no_sync."""
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ToyGPT(d=64), example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):  # the pool and the gradient shards reach their steady size
        model(x, x).backward()
    before = _live_bytes([])[0]
    with model.no_sync():
        for _ in range(2):
            model(x, x).backward()
    grown = _live_bytes([])[0] - before
    held = sum(loc.full.numel() * loc.full.element_size() for loc in get_engine().local_grads.pending())
    return held, model.plan.estimates[str(bmt.world_size())].no_sync_grads, grown


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_plan_states_what_a_window_holds(world_size: int) -> None:
    for held, estimated, grown in run_distributed(_window_memory_body, world_size):
        assert held == estimated > 0, (held, estimated)
        # Buffers the pool keeps between steps (as large as a block's gradient) absorb part of it.
        assert 0 < grown <= estimated, (grown, estimated)


def _lightning_body() -> list[tuple[int, int]]:
    """Reduce-scatter (calls, bytes) of a backward inside ShardedStrategy's block_backward_sync (what
    Lightning's loop enters on accumulating batches), then of one outside it."""
    from bmt_wrap.integrations.lightning import ShardedStrategy

    _, network = _build("plain", {})
    holder = torch.nn.Module()
    holder.net = network  # a LightningModule holds the wrapped network
    strategy = ShardedStrategy()
    strategy.model = holder
    x = torch.randint(0, 64, (2, 8))
    seen = []
    for block in (True, False):
        bmt.reset_comm_stats()
        with strategy.block_backward_sync() if block else contextlib.nullcontext():
            network(x, x).backward()
        seen.append(_reduce_scatters())
    return seen


def test_lightning_accumulating_batches_communicate_no_gradient() -> None:
    for inside, outside in run_distributed(_lightning_body, 2):
        assert inside == (0, 0) and outside[1] > 0, (inside, outside)
