"""Bad input and misuse: each a named bmt_wrap error with the fix in the message, never a hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import models
import pytest
import torch
from dist_harness import raised, run_distributed
from torch import nn
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.block import CheckpointBlock
from bmt_wrap.distributed import get_state
from bmt_wrap.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    UninitializedParameterError,
    WrapError,
)
from bmt_wrap.runtime.comm import FingerprintCommunicator

BLOCKS3 = [f"layers.{i}" for i in range(3)]


def _wrapped(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    m = ToyGPT(**kwargs)
    return apply_plan(m, manual_plan(m, BLOCKS3))


def _wrap_twice_body() -> None:
    m = _wrapped()
    with pytest.raises(WrapError, match="already wrapped"):
        apply_plan(m, manual_plan(ToyGPT(), BLOCKS3))
    with pytest.raises(WrapError, match="already a CheckpointBlock"):
        CheckpointBlock(m.layers[0])


def _cast_after_wrap_body() -> None:
    m = _wrapped()
    with pytest.raises(WrapError, match=r"before wrapping.*mixed_precision"):
        m.half()
    with pytest.raises(WrapError, match="layers.0"):
        m.layers[0].to(torch.float64)
    m.to("cpu")  # a no-op move is fine
    m.float()


def _meta_at_forward_body() -> None:
    with torch.device("meta"):
        m = ToyGPT()
    m = apply_plan(m, manual_plan(m, BLOCKS3))
    with pytest.raises(UninitializedParameterError, match=r"wte.weight.*init_parameters"):
        m(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("body", [_wrap_twice_body, _cast_after_wrap_body, _meta_at_forward_body],
                         ids=lambda f: f.__name__.strip("_"))
def test_misuse_raises_a_named_error(body, world_size: int) -> None:
    run_distributed(body, world_size)


def test_mixed_devices_are_refused_naming_both_parameters() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    run_distributed(_mixed_devices_body, 1)
    assert FakeTensorMode  # the body uses it; imported here so a missing API fails loudly at collection


def _mixed_devices_body() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = ToyGPT()
    with FakeTensorMode(allow_non_fake_inputs=True):
        # A fake CUDA tensor stands in for a parameter left on another device (no GPU needed).
        m.layers[1].fc.weight = nn.Parameter(torch.empty(64, 16, device="cuda"))
    with pytest.raises(WrapError, match=r"different devices.*layers.1.fc.weight"):
        apply_plan(m, manual_plan(m, BLOCKS3))


def _skip_block_body(mode: str) -> str:
    state = get_state()
    inner = state.comm.inner
    if mode == "debug":
        state.comm.inner = FingerprintCommunicator(inner)
    inner.check_order = mode != "unchecked"  # BMT_WRAP_CHECK_COLLECTIVES=0
    # Unchecked, a timeout is the expected end (any rank's, however early): 3 s of waiting show it.
    state.comm.timeout = timedelta(seconds=3 if mode == "unchecked" else 300)
    try:
        torch.manual_seed(0)
        m = ToyGPT(n_layers=3)
        original = m.forward

        def forward(idx, targets=None):
            if bmt.rank() == 1:  # data-dependent control flow that differs across ranks
                m.layers = nn.ModuleList([m.layers[0], m.layers[2]])
            try:
                return original(idx, targets)
            finally:
                m.layers = layers

        m = apply_plan(m, manual_plan(m, BLOCKS3))
        layers = m.layers
        m.forward = forward
        idx = torch.randint(0, 64, (2, 8))
        m(idx, idx).backward()
        bmt.barrier()
        return "completed"
    except CollectiveMismatchError as exc:
        assert "layers." in str(exc) and "layer drop" in str(exc), str(exc)
        return "mismatch"
    except CommTimeoutError:
        return "timeout"
    finally:
        state.comm.inner = inner
        inner.check_order = True


@pytest.mark.parametrize("mode", ["default", "debug", "unchecked"])
def test_rank_skipping_a_block_makes_every_rank_raise(mode: str) -> None:
    start = time.monotonic()
    results = run_distributed(_skip_block_body, 2, mode, timeout=90)
    assert "completed" not in results, results
    # By default (and in debug mode) every rank names the block at the first divergent collective, long
    # before the 300 s timeout; with the order check off one rank times out and the other loses its peer.
    assert results == (["timeout", "timeout"] if mode == "unchecked" else ["mismatch", "mismatch"]), results
    if mode != "unchecked":
        assert time.monotonic() - start < 30


def _outside_use_body() -> None:
    from bmt_wrap.module import DistributedModule

    class Model(DistributedModule):
        def __init__(self) -> None:
            super().__init__()
            self.block = CheckpointBlock(nn.Linear(4, 4))
            self.head = nn.Linear(4, 4)
            self.head.weight = self.block.weight  # the block's parameter used outside the block

        def forward(self, x):
            return self.head(self.block(x))

    with pytest.raises(WrapError, match=r"weight"):
        Model()(torch.ones(2, 4))


@pytest.mark.parametrize("world_size", [1, 2])
def test_block_parameter_used_outside_the_block(world_size: int) -> None:
    run_distributed(_outside_use_body, world_size)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _second_backward_refused(model: nn.Module, name: str, step: Callable[[], torch.Tensor]) -> None:
    """A second backward through one forward raises naming retain_graph, before any of it ran; the next step
    gets the first one's gradients again."""
    loss = step()
    loss.backward(retain_graph=True)
    first = _grads(model)
    with pytest.raises(WrapError, match=f"second backward through one forward of the wrapped {name} .*retain_graph"):
        loss.backward()
    same = [a is b is None or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(_grads(model), first, strict=True)]
    assert all(same) and any(g is not None for g in first)
    model.zero_grad()
    step().backward()
    same = [a is b is None or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(_grads(model), first, strict=True)]
    assert all(same)


def _retain_graph_body(checkpoint: bool) -> None:
    # Issue 49: plain PyTorch runs backward(retain_graph=True) twice and doubles the gradients; the wrapper frees
    # what a second backward reads, and it failed with autograd's raw in-place-version error on the root's buffer.
    torch.manual_seed(0)
    m = ToyGPT()
    m = apply_plan(m, manual_plan(m, BLOCKS3, checkpoint=checkpoint))
    idx = torch.randint(0, 64, (2, 8))
    _second_backward_refused(m, "ToyGPT", lambda: m(idx, idx))
    if checkpoint:  # a transformers model as users build it, wrapped with defaults
        llama = bmt.BMTrainModelWrapper(models.llama())
        ids = models.token_ids(2, 8)
        _second_backward_refused(llama, "LlamaForCausalLM", lambda: llama(input_ids=ids, labels=ids).loss)
    # A block alone (no root group in the graph) names the problem itself.
    out = m.layers[1](torch.randn(1, 4, 16, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(WrapError, match="retain_graph"):
        out.backward()


@pytest.mark.parametrize("checkpoint, world_size", [(True, 1), (True, 2), (False, 2)])
def test_second_backward_is_refused_by_name(checkpoint: bool, world_size: int) -> None:
    run_distributed(_retain_graph_body, world_size, checkpoint)


def _peer_dies_body() -> tuple[str, float]:
    import os

    from bmt_wrap.errors import PeerLostError

    state = get_state()
    state.comm.timeout = timedelta(seconds=40)
    if state.rank == 0:  # dies while rank 1 waits in a collective
        time.sleep(1.0)
        os._exit(1)
    start = time.monotonic()
    # Issue 49: an async op (a reduce-scatter in backward) that nobody waits on yet meets the loss, and the
    # next op is what the user sees; it must name the lost rank and the earlier failure, not only "unusable".
    handle = state.comm.reduce_scatter_into(torch.empty(4), torch.ones(8), async_op=True, label="grads")
    while state.comm.broken is None and time.monotonic() - start < 30:
        time.sleep(0.05)
    with pytest.raises(PeerLostError, match="rank 0 closed its connection") as info:
        state.comm.all_reduce(torch.ones(4), label="after the peer left")
    assert isinstance(info.value, CommTimeoutError)  # fatal like a timeout: one type to catch
    assert "all_reduce" in str(info.value) and "reduce_scatter_into" in str(info.value), info.value
    with pytest.raises(PeerLostError, match="rank 0 closed its connection"):
        handle.wait()
    return "peer lost", time.monotonic() - start


def test_peer_that_died_is_one_named_error_within_seconds() -> None:
    from dist_harness import DistributedTestError

    with pytest.raises(DistributedTestError, match="rank 0: worker process died") as info:
        run_distributed(_peer_dies_body, 2, timeout=90)
    assert len(info.value.errors) == 1, info.value.errors  # rank 1 returned, with the named error
    verdict, seconds = info.value.results[1]
    assert verdict == "peer lost" and seconds < 20, info.value.results


def _killed_mid_step_body(victim: int) -> tuple[str, str]:
    import os
    import signal

    get_state().comm.timeout = timedelta(seconds=40)
    model = bmt.BMTrainModelWrapper(ToyGPT())
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx).backward()  # one whole step first: the groups and schedule are set up

    def die_in_backward(_module: nn.Module, args: tuple) -> None:  # once the head's backward is done
        args[0].register_hook(lambda _grad: os.kill(os.getpid(), signal.SIGKILL))

    if bmt.rank() == victim:  # SIGKILL in the middle of backward, before the blocks' backward
        model.ln_f.register_forward_pre_hook(die_in_backward)
    loss = model(idx, idx)
    return raised(loss.backward)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_step_is_named_by_the_survivor(victim: int) -> None:
    # Issue 49: whichever rank dies, the other's error names it (it named rank 0's loss only).
    from dist_harness import DistributedTestError

    with pytest.raises(DistributedTestError, match=f"rank {victim}: worker process died") as info:
        run_distributed(_killed_mid_step_body, 2, victim, timeout=120)
    kind, message = info.value.results[1 - victim]
    assert kind == "PeerLostError" and f"rank {victim} closed its connection" in message, message
