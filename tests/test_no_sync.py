"""``model.no_sync()``: micro-batches accumulate on each rank with no reduce-scatter, and the first backward
outside reduces everything, so the step equals plain PyTorch accumulating the same micro-batches."""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta

import pytest
import torch
from dist_harness import raised, run_distributed
from parity import LOSS_RTOL, compare_grads, compare_params, lm_batches
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.distributed import get_state

WORLD_SIZES = [1, 2, 4]
MICRO = 4
CASES = {
    "checkpointed": {},
    "not-checkpointed": {"checkpoint": False},
    "zero2": {"zero_level": 2, "checkpoint": False},
}


def _wrap(model: torch.nn.Module, plan_kwargs: dict, mixed: bool) -> torch.nn.Module:
    if mixed:
        return bmt.BMTrainModelWrapper(model, mixed_precision=bmt.MixedPrecision(param_dtype=torch.bfloat16),
                                       **plan_kwargs)
    return apply_plan(model, manual_plan(model, [f"layers.{i}" for i in range(3)], **plan_kwargs))


def _reduce_scatter_bytes() -> int:
    return bmt.comm_stats().get("reduce_scatter_into", {}).get("bytes", 0)


def _micro_batches(batch: tuple[torch.Tensor, ...], rank: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's slice of ``batch``, in ``MICRO`` micro-batches."""
    return list(zip(*(t.chunk(n)[rank].chunk(MICRO) for t in batch), strict=True))


def _global_micro_batches(batch: tuple[torch.Tensor, ...], n: int) -> list[tuple[torch.Tensor, ...]]:
    """Micro-batch k of every rank, together: what plain PyTorch accumulates to match."""
    per_rank = [_micro_batches(batch, r, n) for r in range(n)]
    return [tuple(torch.cat([per_rank[r][k][j] for r in range(n)]) for j in range(len(batch)))
            for k in range(MICRO)]


def _accumulate(model: torch.nn.Module, micro: list[tuple[torch.Tensor, ...]], sync_every: bool,
                window_bytes: list[int]) -> float:
    """Backward of each micro-batch's loss / MICRO; all but the last under no_sync unless ``sync_every``."""
    total = 0.0
    for k, (x, y) in enumerate(micro):
        last = k == len(micro) - 1
        bmt.reset_comm_stats()
        with contextlib.nullcontext() if last or sync_every else model.no_sync():
            loss = model(x, y)
            (loss / MICRO).backward()
        if not last:
            window_bytes.append(_reduce_scatter_bytes())
        total += float(loss) / MICRO
    return total


def _parity_body(plan_kwargs: dict, mixed: bool = False, steps: int = 2) -> dict:
    """Train ``steps`` steps of MICRO micro-batches against a reference: plain one-process fp32 torch
    accumulating the global micro-batches, or under mixed precision (which plain fp32 cannot match) the same
    wrapped model reducing every micro-batch."""
    rank, n = bmt.rank(), bmt.world_size()
    torch.manual_seed(0)
    plain = ToyGPT()
    model = _wrap(copy.deepcopy(plain), plan_kwargs, mixed)
    reference = "synced" if mixed else "plain"
    ref = _wrap(copy.deepcopy(plain), plan_kwargs, mixed) if mixed else plain
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window_bytes: list[int] = []
    losses, ref_losses = [], []
    for step, batch in enumerate(lm_batches(steps, 16)):
        if reference == "plain":
            ref_loss = 0.0
            for x, y in _global_micro_batches(batch, n):
                loss = ref(x, y)
                (loss / MICRO).backward()
                ref_loss += float(loss) / MICRO
        else:
            ref_loss = float(bmt.sum_loss(torch.tensor(_accumulate(ref, _micro_batches(batch, rank, n), True, []))))
        loss = _accumulate(model, _micro_batches(batch, rank, n), False, window_bytes)
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_no_sync_accumulation_equals_plain_pytorch(case: str, world_size: int) -> None:
    results = run_distributed(_parity_body, world_size, CASES[case])
    for r in results:
        assert r["window_bytes"] == [0] * 2 * (MICRO - 1), r["window_bytes"]
    assert results[0]["losses"][-1] < results[0]["losses"][0]
