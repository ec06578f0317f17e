"""A backward that fails midway (RecomputeError, an exception from a user hook) leaves no engine state behind:
the same model, or another one, then trains as plain PyTorch does, and the aborted step's gradients are never
applied. Each body fails and then trains in one process, without the harness's engine reset in between."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from dist_harness import run_distributed
from parity import compare_grads, lm_batches, train_side_by_side
from toy import Layer, ToyGPT

import bmt_wrap as bmt
from bmt_wrap.distributed import get_state
from bmt_wrap.errors import CollectiveMismatchError, CommTimeoutError, RecomputeError
from bmt_wrap.runtime.process_engine import get_engine

STEPS = 3


class _Injected(RuntimeError):
    """Raised from a gradient hook, standing in for any user error in backward."""


class _FlakyLayer(Layer):
    """While ``flaky`` is set, every other call saves two more tensors for backward (same values), so a
    checkpointed call's recompute differs from its forward: RecomputeError in backward."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.flaky = False
        self.calls = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        if self.flaky:
            self.calls += 1
            if self.calls % 2 == 0:
                x = x + (x.tanh() - x.tanh())
        return super().forward(x, mask, scale)


class _FragileGPT(ToyGPT):
    """ToyGPT whose backward can be made to fail after its last block's backward, before the middle one's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_FlakyLayer(16) for _ in range(3))
        self.fail: str | None = None  # "recompute", "hook", or "hook-rank0" (rank 0 only)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.layers[1].flaky = self.fail == "recompute"
        if self.fail in ("hook", "hook-rank0"):
            return self._with_hook(idx, targets)
        return super().forward(idx, targets)

    def _with_hook(self, idx: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe[:t]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for i, layer in enumerate(self.layers):
            x = layer(x, mask)
            if i == 1 and (self.fail == "hook" or bmt.rank() == 0):
                x.register_hook(_raise)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise _Injected("injected failure in backward")


_ERRORS = {"recompute": RecomputeError, "hook": _Injected, "hook-rank0": _Injected}


def _fail_once(model: _FragileGPT, mode: str) -> None:
    """One step whose backward raises midway; the caller catches it, as a notebook user would."""
    n, rank = bmt.world_size(), bmt.rank()
    idx, targets = (t.chunk(n)[rank] for t in lm_batches(1, 4, vocab=64, seed=7)[0])
    model.fail = mode
    # The first call of a flaky layer saves as a plain one: the failure comes from its recompute.
    with pytest.raises(_ERRORS[mode]):
        model(idx, targets).backward()
    model.fail = None


def _wrap_after_failure(mode: str) -> Callable[[_FragileGPT], _FragileGPT]:
    """Wrap, then run one step whose backward fails (before the side-by-side training starts)."""

    def wrap(model: _FragileGPT) -> _FragileGPT:
        wrapped = bmt.BMTrainModelWrapper(model)
        _fail_once(wrapped, mode)
        # The failed step's gradients are not applied: every parameter keeps the .grad it had (None).
        assert [n for n, p in wrapped.named_parameters() if p.grad is not None] == []
        return wrapped
    return wrap


def _assert_engine_idle() -> None:
    """After a completed step nothing is left of the failed one: no gather held, no reduction pending."""
    engine = get_engine()
    assert [g.name for g in engine.groups if g.gathered or g.in_use] == []
    assert not engine._acquired_calls and not engine.reducer._pending and not engine.reducer._touched
    assert not engine.reducer.callback_queued


def _same_model_trains_after_failure(mode: str) -> dict:
    """The model whose backward failed then trains as a plain copy that never took the failed step."""
    out = train_side_by_side(_FragileGPT, _wrap_after_failure(mode), lm_batches(STEPS, 4, vocab=64))
    _assert_engine_idle()
    return out


def _other_model_trains_after_failure(mode: str) -> dict:
    """One model's backward fails, then another model (same process and engine) trains as plain PyTorch."""
    torch.manual_seed(1)
    failed = bmt.BMTrainModelWrapper(_FragileGPT())
    _fail_once(failed, mode)
    out = train_side_by_side(ToyGPT, bmt.BMTrainModelWrapper, lm_batches(STEPS, 4, vocab=64))
    _assert_engine_idle()
    return out


def _second_loss_after_failed_first() -> None:
    """Two forwards, then the first loss's backward fails: the second loss's backward (no forward in between)
    gives exactly its own gradients."""
    n, rank = bmt.world_size(), bmt.rank()
    torch.manual_seed(0)
    ref = _FragileGPT()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    (idx1, t1), (idx2, t2) = lm_batches(2, 4, vocab=64, seed=7)
    model.fail = "hook"
    loss1 = model(idx1.chunk(n)[rank], t1.chunk(n)[rank])
    model.fail = None
    loss2 = model(idx2.chunk(n)[rank], t2.chunk(n)[rank])
    with pytest.raises(_Injected):
        loss1.backward()
    loss2.backward()
    ref(idx2, t2).backward()
    compare_grads(ref, model, "second loss")
    _assert_engine_idle()


@pytest.mark.parametrize("world_size", [1, 2])
def test_backward_of_another_loss_after_a_failed_one_matches_plain_pytorch(world_size: int) -> None:
    run_distributed(_second_loss_after_failed_first, world_size)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "hook"])
@pytest.mark.parametrize("body", [_same_model_trains_after_failure, _other_model_trains_after_failure],
                         ids=["same-model", "other-model"])
def test_training_after_a_failed_backward_matches_plain_pytorch(body, mode: str, world_size: int) -> None:
    run_distributed(body, world_size, mode)


def _one_rank_fails() -> str:
    """Only rank 0's backward raises: the ranks' collectives diverge, and every rank gets a named error."""
    state = get_state()
    state.comm.timeout = timedelta(seconds=20)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(_FragileGPT())
    idx, targets = lm_batches(1, 4, vocab=64)[0]
    try:
        if bmt.rank() == 0:
            _fail_once(model, "hook-rank0")
        else:
            model.fail = "hook-rank0"
            model(idx.chunk(2)[1], targets.chunk(2)[1]).backward()
            model.fail = None
        for batch in lm_batches(2, 4, vocab=64):
            model(*(t.chunk(2)[bmt.rank()] for t in batch)).backward()
        bmt.barrier()
        return "completed"
    except CollectiveMismatchError:
        return "mismatch"
    except CommTimeoutError:
        return "timeout"


def test_a_backward_failing_on_one_rank_is_a_named_error_on_every_rank() -> None:
    # Rank 0 recovers and gathers the root for its next forward while rank 1 still runs its backward: the
    # order check names both sides on both ranks.
    assert run_distributed(_one_rank_fails, 2, timeout=90) == ["mismatch", "mismatch"]
